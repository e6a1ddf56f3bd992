"""`dlworker` end to end: real agents, real worker processes, real gloo
process groups, a real `dlmaster`; the scenarios torch tests its own agent with,
plus preemption and an unreachable master."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import assert_exactly_once
from harness import MasterProcess
from netns import Output

from dlfleet.api.client import MasterClient
from dlfleet.worker.checkpoint import persist

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).parent / "scripts" / "allreduce_steps.py"
LEDGER_SCRIPT = Path(__file__).parent / "scripts" / "ledger_train.py"
UNRECORDED_SCRIPT = Path(__file__).parent / "scripts" / "unrecorded_failure.py"
KILLED_PEER_SCRIPT = Path(__file__).parent / "scripts" / "killed_peer_steps.py"
TOKEN = "test-token"


class Workers:
    """The training outputs of a run, read back from OUT_DIR."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def steps(self, round_: int | str, rank: int) -> list[dict[str, float]]:
        path = self.out / f"steps-r{round_}-g{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def env(self, round_: int, rank: int) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.out / f"env-r{round_}-g{rank}.json").read_text())
        return data

    def wait_for_steps(self, round_: int, rank: int, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps(round_, rank)) < count:
            assert time.monotonic() < deadline, f"rank {rank} of round {round_} made no progress"
            time.sleep(0.05)


@pytest.fixture
def job(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> Iterator[Callable[..., tuple[MasterProcess, Callable[..., subprocess.Popen[str]], Workers]]]:
    agents: list[subprocess.Popen[str]] = []

    def start(
        min_nodes: int, max_nodes: int, *master_flags: str
    ) -> tuple[MasterProcess, Callable[..., subprocess.Popen[str]], Workers]:
        store = f"sqlite:///{tmp_path / 'master.db'}"
        flags: tuple[str, ...] = ("--min-nodes", str(min_nodes), "--max-nodes", str(max_nodes))
        flags += ("--last-call-timeout", "0.3", *master_flags)
        master = master_process(store, *flags)
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)

        def agent(
            name: str,
            *,
            steps: int = 5,
            pause: float = 0.05,
            nproc: int = 1,
            max_restarts: int = 0,
            env: dict[str, str] | None = None,
            flags: tuple[str, ...] = (),
            script: Path = SCRIPT,
        ) -> subprocess.Popen[str]:
            argv = [
                sys.executable, "-m", "dlfleet.worker.agent.loop",
                "--nnodes", f"{min_nodes}:{max_nodes}", "--nproc-per-node", str(nproc),
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
                "--master", master.address, "--node-name", name,
                "--log-dir", str(tmp_path / "logs" / name), *flags,
                str(script), str(out), str(steps), str(pause),
            ]  # fmt: skip
            proc = subprocess.Popen(
                argv,
                env={**os.environ, "DLFLEET_TOKEN": TOKEN, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            agents.append(proc)
            return proc

        return master, agent, Workers(out)

    yield start
    for proc in agents:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_two_agents_train_together_with_every_torchrun_variable_set(
    job: Callable[..., Any],
) -> None:
    master, agent, workers = job(2, 2)
    a, b = agent("a", nproc=1), agent("b", nproc=2)
    for proc in (a, b):
        code, out = finish(proc)
        assert code == 0, out
    assert [s["sum"] for s in workers.steps(1, 0)] == [3.0] * 5
    envs = [workers.env(1, rank) for rank in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    # Whichever node joined first leads; global rank = offset of its group + local rank.
    sizes = {"a#1": 1, "b#1": 2}
    leader = envs[0]["DLFLEET_NODE_ID"]
    offsets = {leader: 0, ({"a#1", "b#1"} - {leader}).pop(): sizes[leader]}
    for env in envs:
        node = env["DLFLEET_NODE_ID"]
        assert int(env["RANK"]) == offsets[node] + int(env["LOCAL_RANK"])
        assert env["LOCAL_WORLD_SIZE"] == str(sizes[node])
        assert env["GROUP_RANK"] == ("0" if node == leader else "1")
    for env in envs:
        assert env["GROUP_WORLD_SIZE"] == "2" and env["ROLE_WORLD_SIZE"] == "3"
        assert env["ROLE_RANK"] == env["RANK"] and env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "none"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
        assert env["DLFLEET_MASTER"] == master.address and env["DLFLEET_ROUND"] == "1"
        assert env["DLFLEET_NODE_ID"] in ("a#1", "b#1")
        assert env["DLFLEET_MAX_NODES"] == "2"  # the master's: the largest world's nodes


def test_a_killed_agent_restarted_rejoins_and_both_finish(job: Callable[..., Any]) -> None:
    _, agent, workers = job(2, 2)
    a = agent("a", steps=40, pause=0.05)
    b = agent("b", steps=40, pause=0.05)
    workers.wait_for_steps(1, 1, 3)
    b.kill()  # the agent dies; its worker dies with it, A's is stopped by the push
    b.wait()
    b2 = agent("b", steps=40, pause=0.05)
    for proc in (a, b2):
        code, out = finish(proc)
        assert code == 0, out
    assert [s["sum"] for s in workers.steps(2, 0)] == [2.0] * 40
    assert [s["sum"] for s in workers.steps(2, 1)] == [2.0] * 40


def test_the_survivor_of_a_dead_node_reforms_alone_without_waiting_for_a_timeout(
    job: Callable[..., Any],
) -> None:
    _, agent, workers = job(1, 2, "--heartbeat-timeout", "60")
    a = agent("a", steps=30, pause=0.05)
    b = agent("b", steps=30, pause=0.05)
    workers.wait_for_steps(1, 0, 3)
    killed = time.monotonic()
    b.kill()
    workers.wait_for_steps(2, 0, 1, timeout=30)
    assert time.monotonic() - killed < 15, "re-formed by the push, not a 60 s timeout"
    code, out = finish(a)
    assert code == 0, out
    assert [s["sum"] for s in workers.steps(2, 0)] == [1.0] * 30


def test_a_rank_that_fails_once_recovers_within_max_restarts(job: Callable[..., Any]) -> None:
    _, agent, workers = job(1, 1)
    a = agent("a", nproc=2, max_restarts=3, env={"FAIL_MODE": "once"})
    code, out = finish(a)
    assert code == 0, out
    assert "restart 1 of 3" in out
    assert [s["sum"] for s in workers.steps(2, 0)] == [2.0] * 5
    assert workers.env(2, 1)["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_a_rank_that_always_fails_exhausts_restarts_with_the_root_cause(
    job: Callable[..., Any],
) -> None:
    """torchrun's policy (diagnosis off): the same error, restarted until none are left."""
    _, agent, _ = job(1, 1)
    a = agent(
        "a", nproc=2, max_restarts=2, env={"FAIL_MODE": "always"}, flags=("--diagnosis", "off")
    )
    code, out = finish(a)
    assert code == 1
    assert "restart 2 of 2" in out
    assert "local rank 0 on a#1" in out and "rank 0 always fails" in out
    # The node's last word says it ends, not that it restarts.
    last = [line for line in out.splitlines() if "dlworker a#1 failed: " in line][-1]
    assert last.endswith(
        "(rule diagnosis-off), not restarted: its 2 restarts (max_restarts) are spent"
    ), last


def test_a_rank_that_fails_the_same_way_twice_stops_restarting(job: Callable[..., Any]) -> None:
    _, agent, _ = job(1, 1)
    a = agent("a", nproc=2, max_restarts=5, env={"FAIL_MODE": "always"})
    code, out = finish(a)
    assert code == 1
    assert "restart 1 of 5" in out and "restart 2 of 5" not in out
    assert "diagnosed user_error (rule same-error-again): fail_job" in out
    assert "rank 0 always fails" in out


def test_a_script_without_record_that_fails_the_same_way_twice_stops_restarting(
    job: Callable[..., Any],
) -> None:
    """Lightning and HF scripts never use @record, and without --redirects or
    --tee the agent keeps none of their stderr: the exception is still read
    (the workers' sitecustomize writes the error file)."""
    _, agent, _ = job(1, 1)
    a = agent("a", nproc=2, max_restarts=3, script=UNRECORDED_SCRIPT)
    code, out = finish(a)
    assert code == 1
    assert "restart 1 of 3" in out and "restart 2 of 3" not in out
    assert "diagnosed user_error (rule same-error-again): fail_job" in out
    assert "ValueError: Expected input batch_size (8) to match target batch_size (4)." in out


def test_a_rank_whose_peer_was_killed_persists_and_restarts_without_waiting_for_it(
    job: Callable[..., Any],
) -> None:
    """Rank 1 is SIGKILLed; the agent stops rank 0 with SIGTERM, and rank 0
    persists the newest step both hold, writing rank 1's part from its image
    in the node's folder: the restart follows the kill within moments, not
    after the 5 s rank 0 would wait for a part that never comes."""
    _, agent, workers = job(1, 1)
    a = agent("a", nproc=2, max_restarts=1, steps=1000, pause=0.05, script=KILLED_PEER_SCRIPT)
    code, out = finish(a)
    assert code == 0, out
    assert "rank 1 is gone; writing its part of step 5 from its image" in out
    assert "terminated: persisted step 5 first" in out
    killed = re.search(r"killed at ([0-9.]+)", out)
    restart = re.search(r"^(\S+ \S+),(\d+) dlworker WARNING .*; restart 1 of 1$", out, re.M)
    assert killed is not None and restart is not None, out
    restarted_at = time.mktime(time.strptime(restart.group(1), "%Y-%m-%d %H:%M:%S"))
    restarted_at += int(restart.group(2)) / 1000
    assert restarted_at - float(killed.group(1)) < 3.0, out
    newest = persist.newest_persisted(workers.out / "disk")
    assert newest is not None and newest[0] == 5
    assert persist.load_persisted_full(newest[1])["step"] == 5


def test_a_silent_hang_is_turned_into_a_restart_by_the_step_watchdog(
    job: Callable[..., Any],
) -> None:
    _, agent, workers = job(1, 1)
    a = agent(
        "a", nproc=2, steps=8, pause=0.2, max_restarts=1, env={"FAIL_MODE": "hang"},
        flags=("--step-timeout", "2"),
    )  # fmt: skip
    started = time.monotonic()
    code, out = finish(a, timeout=90)
    assert code == 0, out
    assert "hung: no training step for" in out and "--step-timeout 2s" in out
    assert len(workers.steps(1, 0)) == 3  # stuck before step 3 (steps 0, 1, 2 done)
    assert [s["sum"] for s in workers.steps(2, 0)] == [2.0] * 8  # the restart finished
    assert time.monotonic() - started < 60


def test_a_learned_step_bound_catches_a_hang_long_before_the_fixed_one(
    job: Callable[..., Any],
) -> None:
    """Ranks that step every 0.05 s report every ~0.5 s: the learned bound
    is 3 x the longest gap, about 1.6 s, not the 120 s ceiling."""
    _, agent, workers = job(1, 1)
    a = agent(
        "a", nproc=2, steps=110, pause=0.05, max_restarts=1,
        env={"FAIL_MODE": "hang", "HANG_STEP": "100"},
        flags=("--step-timeout", "120", "--step-timeout-factor", "3", "--step-timeout-min", "1"),
    )  # fmt: skip
    code, out = finish(a, timeout=120)
    assert code == 0, out
    found = re.search(r"hung: no training step for ([0-9.]+)s \(3 x the longest gap", out)
    assert found is not None, out
    assert float(found.group(1)) < 5, out
    assert len(workers.steps(1, 0)) == 100  # stuck before step 100
    assert [s["sum"] for s in workers.steps(2, 0)] == [2.0] * 110  # the restart finished


def test_scale_up_from_one_node_to_two_mid_run(job: Callable[..., Any]) -> None:
    _, agent, workers = job(1, 2)
    a = agent("a", steps=40, pause=0.05)
    workers.wait_for_steps(1, 0, 3)
    assert {s["world"] for s in workers.steps(1, 0)} == {1}
    b = agent("b", steps=40, pause=0.05)
    for proc in (a, b):
        code, out = finish(proc)
        assert code == 0, out
    assert [s["sum"] for s in workers.steps(2, 0)] == [2.0] * 40
    assert [s["sum"] for s in workers.steps(2, 1)] == [2.0] * 40


def test_a_preempted_agent_exits_143_and_the_others_reform_at_once(
    job: Callable[..., Any],
) -> None:
    _, agent, workers = job(1, 2, "--heartbeat-timeout", "60")
    a = agent("a", steps=30, pause=0.05)
    b = agent("b", steps=30, pause=0.05)
    workers.wait_for_steps(1, 1, 3)
    preempted = time.monotonic()
    b.send_signal(signal.SIGTERM)
    code, out = finish(b, timeout=30)
    assert code == 143, out  # left when told to: not "done", a platform replaces it
    workers.wait_for_steps(2, 0, 1, timeout=30)
    assert time.monotonic() - preempted < 15
    code, out = finish(a)
    assert code == 0, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_node_waiting_for_a_round_says_why_and_leaves_at_once_when_told(
    job: Callable[..., Any], signum: signal.Signals
) -> None:
    """Alone under min_nodes 2: every few seconds the node says who waits and
    how many a round needs; SIGTERM or Ctrl-C ends the wait at once (143)."""
    _, agent, _ = job(2, 2)
    waiting = Output("a", agent("a"))
    waiting.wait_for(
        r"waiting \d+s for a round: 1 node\(s\) waiting \(a#1\); a round needs min_nodes 2: "
        r"waiting for 1 more, at most \d+s more",
        timeout=30,
    )
    told = time.monotonic()
    waiting.proc.send_signal(signum)
    assert waiting.wait_exit(10) == 143, waiting.tail()
    assert time.monotonic() - told < 3, waiting.tail()


def test_an_unreachable_master_ends_in_a_clear_error(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "dlfleet.worker.agent.loop", "--master", "127.0.0.1:1",
        str(SCRIPT), str(tmp_path), "1", "0",
    ]  # fmt: skip
    env = {**os.environ, "DLFLEET_TOKEN": TOKEN, "DLFLEET_CONNECT_BUDGET": "2"}
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3  # the node is lost to the job; a platform may replace it
    assert "cannot register with the master at 127.0.0.1:1" in done.stderr
    assert time.monotonic() - started < 30


def test_bad_flags_exit_2_naming_the_flag(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "dlfleet.worker.agent.loop", "--nnodes", "3:2", "x.py"]
    env = {**os.environ, "DLFLEET_TOKEN": TOKEN, "DLFLEET_MASTER": "127.0.0.1:5"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--nnodes" in done.stderr


def run_two_torchruns(
    tmp_path: Path,
    master_process: Callable[..., MasterProcess],
    *flags: str,
    env: dict[str, str] | None = None,
    script: list[str] | None = None,
) -> tuple[MasterProcess, Workers]:
    """Two stock torchrun nodes of one process each, rendezvousing through a
    master, running `script` (the script and its arguments; by default
    SCRIPT for 5 steps); both must exit 0."""
    master = master_process(
        f"sqlite:///{tmp_path / 'm.db'}", "--min-nodes", "2", "--max-nodes", "2",
        "--last-call-timeout", "0.3",
    )  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    torchrun = Path(sys.executable).parent / "torchrun"
    argv = [
        str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", *flags,
        "--rdzv-backend", "dlfleet", "--rdzv-endpoint", master.address, "--rdzv-id", "job",
        "--monitor-interval", "0.1", *(script or [str(SCRIPT), str(out), "5", "0.05"]),
    ]  # fmt: skip
    environ = {**os.environ, "DLFLEET_TOKEN": TOKEN, **(env or {})}
    procs = [
        subprocess.Popen(
            argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    for proc in procs:
        code, log = finish(proc)
        assert code == 0, log
        assert "no dlfleet master" not in log, log
    return master, Workers(out)


def rounds_run(workers: Workers) -> list[int]:
    """The rounds in which some rank logged steps."""
    return sorted({int(p.name.split("-")[1][1:]) for p in workers.out.glob("steps-r*-g*.jsonl")})


def test_stock_torchrun_forms_its_world_through_the_master(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> None:
    _, workers = run_two_torchruns(tmp_path, master_process)
    assert rounds_run(workers) == [1]  # the workers know the master's round
    for rank in (0, 1):
        assert [s["sum"] for s in workers.steps(1, rank)] == [2.0] * 5
        assert workers.env(1, rank)["DLFLEET_MASTER"] is not None


def test_stock_torchrun_restarts_through_the_master_after_a_worker_fails(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> None:
    """Rank 0 exits on the first attempt; its torchrun restarts it, the
    master's push makes the other torchrun restart too, and the second round
    (which the master forms itself, from the spare ports the handler offered)
    trains to the end."""
    _, workers = run_two_torchruns(
        tmp_path, master_process, "--max-restarts", "1", env={"FAIL_MODE": "once"}
    )
    # Only a later round trains (rank 0 of the first exits before its first
    # step), as a world of two, every step summing both ranks' ones.
    (last,) = rounds_run(workers)
    assert last > 1
    steps = [workers.steps(last, rank) for rank in (0, 1)]
    assert [s["sum"] for s in steps[0] + steps[1]] == [2.0] * 10


LEDGER_SIZE = 61  # prime: the last global batch of each epoch is short


@pytest.mark.parametrize("crash", [False, True], ids=["plain", "a-worker-killed"])
def test_stock_torchrun_through_the_master_leases_every_record_exactly_once(
    tmp_path: Path, master_process: Callable[..., MasterProcess], crash: bool
) -> None:
    """Under `torchrun --rdzv-backend=dlfleet` the script's ShardedDataLoader
    leases from the master (the handler gives the workers its address, the
    token, the node and each new round), with no warning; the ledger shows
    every record of both epochs trained once, through a killed worker too
    (restored from the checkpoint in the next round)."""
    ledger = tmp_path / "ledger"
    args = [str(LEDGER_SCRIPT), "--ledger-dir", str(ledger), "--size", str(LEDGER_SIZE)]
    args += ["--batch-size", "4", "--epochs", "2", "--dataset-name", "records"]
    flags: list[str] = []
    if crash:
        args += ["--crash-at-step", "9", "--crash-rank", "0", "--checkpoint-every", "5"]
        flags = ["--max-restarts", "1"]
    master, _ = run_two_torchruns(tmp_path, master_process, *flags, script=args)
    report = assert_exactly_once(ledger, size=LEDGER_SIZE, epochs=2)
    with MasterClient(master.address, token=TOKEN) as client:
        assert client.dataset_status("records").finished  # leased, not sliced by rank
    if crash:
        assert len(report.attempts) >= 2  # rounds: the crash made a new one
        assert report.discarded > 0  # the steps after the checkpoint were rolled back


def test_stock_torchrun_restores_a_killed_worker_from_the_nodes_memory(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> None:
    """Under `torchrun --rdzv-backend=dlfleet`, torchrun's own process keeps
    the node's checkpoint images (the handler runs the keeper): a worker
    killed at step 9 is restarted cold by torchrun, and every rank restores
    step 8, the newest step all saved in memory (nothing is persisted), with
    every record trained once."""
    ledger = tmp_path / "ledger"
    args = [str(LEDGER_SCRIPT), "--ledger-dir", str(ledger), "--size", str(LEDGER_SIZE)]
    args += ["--batch-size", "4", "--epochs", "2", "--dataset-name", "records", "--in-memory"]
    args += ["--crash-at-step", "9", "--crash-rank", "1"]
    master, _ = run_two_torchruns(tmp_path, master_process, "--max-restarts", "1", script=args)
    report = assert_exactly_once(ledger, size=LEDGER_SIZE, epochs=2)
    restores = [json.loads(line) for line in (ledger / "restores.jsonl").read_text().splitlines()]
    assert [r["restored_step"] for r in restores] == [0, 8], restores
    assert len(report.attempts) == 2
    assert not (ledger / "checkpoints" / "persisted").exists()  # from memory, not disk
    with MasterClient(master.address, token=TOKEN) as client:
        assert client.dataset_status("records").finished


def test_a_killed_agent_leaves_no_socket_file_behind(
    job: Callable[..., Any], tmp_path: Path
) -> None:
    """Its workers reach it on a Unix socket that vanishes with it (an
    abstract one), not on a file in /tmp that a SIGKILL leaves there."""
    _, agent, workers = job(1, 1)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    a = agent("a", steps=400, pause=0.05, env={"TMPDIR": str(tmp)})
    workers.wait_for_steps(1, 0, 2)
    a.kill()
    a.wait(10)
    assert sorted(p.name for p in tmp.glob("dlworker-*.sock")) == []
