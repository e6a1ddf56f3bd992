"""In-process restarts end to end: real agents, real gloo groups, a real
`dlmaster`; a script that trains through `dlfleet.elastic.run`.

What must hold: a surviving rank keeps its process across the world change
(no interpreter, import or model build again); a killed rank is taken over by
a spare the agent started ahead; a lost node's survivors go on in place in a
smaller world; a node that joins a running job starts its workers warm, as
spares, before it joins; the job still ends with every agent exiting 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from harness import MasterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).parent / "scripts" / "inprocess_steps.py"
TOKEN = "test-token"


class Run:
    def __init__(self, root: Path, master: MasterProcess, nodes: str) -> None:
        self.root, self.master, self.nodes = root, master, nodes
        self.out = root / "out"
        self.out.mkdir()
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def agent(
        self,
        name: str,
        steps: int,
        pause: float = 0.05,
        *,
        flags: Sequence[str] = (),
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        argv = [
            sys.executable, "-m", "dlfleet.worker.agent.loop",
            "--nnodes", self.nodes, "--nproc-per-node", "1", "--max-restarts", "2",
            "--monitor-interval", "0.1", "--master", self.master.address,
            "--node-name", name, "--log-dir", str(self.root / "logs" / name), *flags,
            str(SCRIPT), str(self.out), str(steps), str(pause), *args,
        ]  # fmt: skip
        with (self.root / f"{name}.log").open("wb") as log:
            self.agents[name] = subprocess.Popen(
                argv,
                env={
                    **os.environ,
                    "DLFLEET_TOKEN": TOKEN,
                    "GLOO_SOCKET_IFNAME": "lo",
                    **(env or {}),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def steps(self) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        for path in sorted(self.out.glob("steps-*.jsonl")):
            lines += [json.loads(raw) for raw in path.read_text().splitlines() if raw.strip()]
        return lines

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.agents)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.05)

    def finish(self, timeout: float = 120) -> dict[str, int]:
        codes = {}
        for name, proc in self.agents.items():
            codes[name] = proc.wait(timeout)
        return codes

    def kill_all(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def run(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> Iterator[Callable[[int, int], Run]]:
    runs: list[Run] = []

    def start(min_nodes: int, max_nodes: int) -> Run:
        store = f"sqlite:///{tmp_path / 'master.db'}"
        master = master_process(
            store, "--min-nodes", str(min_nodes), "--max-nodes", str(max_nodes),
            "--last-call-timeout", "0.3", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", "5",
        )  # fmt: skip
        runs.append(Run(tmp_path, master, f"{min_nodes}:{max_nodes}"))
        return runs[-1]

    yield start
    for started in runs:
        started.kill_all()


def _spare_ready(run: Run, name: str) -> bool:
    return "spare process" in run.log(name) and "attached as a spare" in run.log(name)


def test_a_killed_rank_is_taken_over_by_a_spare_and_the_survivor_keeps_its_process(
    run: Callable[[int, int], Run],
) -> None:
    job = run(2, 2)
    job.agent("a", steps=300)
    job.agent("b", steps=300)
    job.wait(lambda: _spare_ready(job, "a") and _spare_ready(job, "b"), "spares on both nodes")
    # Started with the workers, imports done, then told to run the script.
    assert all("primed at launch" in job.log(n) for n in "ab"), (job.log("a"), job.log("b"))
    first = job.steps()
    assert {line["round"] for line in first} == {1}
    pids = {line["rank"]: line["pid"] for line in first}
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)

    job.wait(lambda: any(line["round"] > 1 for line in job.steps()), "a second round")
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.log("a"), job.log("b"))

    later = [line for line in job.steps() if line["round"] > 1]
    final_round = max(line["round"] for line in later)
    final = {line["rank"]: line for line in later if line["round"] == final_round}
    assert final[0]["pid"] == pids[0], "the survivor was restarted as a new process"
    assert final[0]["index"] >= 1  # its second attempt, same process
    assert final[1]["pid"] != pids[1]
    assert final[1]["started"] < killed_at, "rank 1 was not taken over by a spare started ahead"
    for rank in (0, 1):
        steps = sorted(
            line["step"] for line in later if line["round"] == final_round and line["rank"] == rank
        )
        assert steps == list(range(300))
    assert all(line["sum"] == 2.0 for line in later)
    assert "takes over local rank 0" in job.log("a") + job.log("b")


def test_a_rank_killed_while_its_spare_is_still_starting_waits_for_that_spare(
    run: Callable[[int, int], Run],
) -> None:
    """A spare that has not attached yet (still importing) is further along
    than a process started at the failure: it takes the rank when it attaches."""
    job = run(2, 2)
    slow = {"INPROCESS_STEPS_SPARE_DELAY_S": "4"}
    job.agent("a", steps=150, env=slow)
    job.agent("b", steps=150, env=slow)
    job.wait(lambda: all("started spare process" in job.log(n) for n in "ab"), "spares starting")
    job.wait(lambda: {line["rank"] for line in job.steps()} == {0, 1}, "both ranks training")
    node = next(n for n in "ab" if "round 1: group rank 1 of 2" in job.log(n))  # rank 1's
    assert "attached as a spare" not in job.log(node)
    pids = {line["rank"]: line["pid"] for line in job.steps()}
    os.kill(pids[1], signal.SIGKILL)

    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.log("a"), job.log("b"))
    later = [line for line in job.steps() if line["round"] > 1]
    final = {line["rank"]: line for line in later}
    assert final[0]["pid"] == pids[0], "the survivor was restarted as a new process"
    log = job.log(node)
    first_spare = re.search(r"started spare process (\d+)", log)
    assert first_spare is not None
    spare = first_spare.group(1)  # the one started before the kill
    assert final[1]["pid"] == int(spare), log
    assert f"spare process {spare}, still starting, takes over local rank 0" in log, log
    assert "no spare ready" not in log, log


def test_a_lost_node_leaves_its_peer_training_in_place_in_a_smaller_world(
    run: Callable[[int, int], Run],
) -> None:
    job = run(1, 2)
    job.agent("a", steps=300)
    job.agent("b", steps=300)
    job.wait(lambda: _spare_ready(job, "a"), "a spare on node a")
    job.wait(lambda: len(job.steps()) >= 6, "training")
    pids = {line["rank"]: line["pid"] for line in job.steps() if line["round"] == 1}
    node_a_rank = 0 if "group rank 0" in job.log("a") else 1
    job.agents["b"].kill()  # the agent and, by its parent-death signal, its worker
    job.agents["b"].wait(10)

    def smaller_world() -> bool:
        return any(line["world"] == 1 for line in job.steps())

    job.wait(smaller_world, "a round of world size 1")
    assert job.agents["a"].wait(120) == 0, job.log("a")
    alone = [line for line in job.steps() if line["world"] == 1]
    assert {line["pid"] for line in alone} == {pids[node_a_rank]}
    assert sorted(line["step"] for line in alone) == list(range(300))
    assert all(line["sum"] == 1.0 for line in alone)


def test_a_node_joining_a_job_that_restarts_in_place_starts_its_workers_warm(
    run: Callable[[int, int], Run],
) -> None:
    job = run(1, 2)
    job.agent("a", steps=400)
    job.wait(lambda: "restart in place" in job.log("a"), "node a's workers to opt in")
    time.sleep(1.5)  # a heartbeat (every 0.5 s) tells the master
    joined_at = time.time()
    job.agent("b", steps=400)
    job.wait(lambda: any(line["world"] == 2 for line in job.steps()), "a round of world size 2")
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.log("a"), job.log("b"))

    b_log = job.log("b")
    assert "warm start: 1 of 1 worker(s) warm" in b_log, b_log
    assert "takes over local rank 0" in b_log, b_log
    assert "no spare ready" not in b_log, b_log
    both = [line for line in job.steps() if line["world"] == 2]
    final_round = max(line["round"] for line in both)
    final = [line for line in both if line["round"] == final_round]
    for rank in (0, 1):
        assert sorted(line["step"] for line in final if line["rank"] == rank) == list(range(400))
    assert all(line["sum"] == 2.0 for line in final)
    # Node a's rank kept its process; node b's trained in the process it had
    # started (warm) before joining.
    alone = [line for line in job.steps() if line["world"] == 1]
    assert {line["pid"] for line in final if line["pid"] in {a["pid"] for a in alone}}
    newcomer = [line for line in final if line["pid"] not in {a["pid"] for a in alone}]
    assert newcomer and all(joined_at < line["started"] for line in newcomer)
    last_alone = max(line["time"] for line in alone if line["time"] < newcomer[0]["time"])
    first_together = min(line["time"] for line in both)
    print(f"node a waited {first_together - last_alone:.2f}s for the newcomer")


def test_a_rank_hung_outside_any_collective_is_killed_with_its_stacks_logged(
    run: Callable[[int, int], Run],
) -> None:
    """The watchdog ends the round; the peer leaves at once, the hung rank
    cannot (it sleeps where no abort reaches), so after the abort timeout the
    agent asks it for its stacks, kills it, and a spare takes its rank."""
    job = run(2, 2)
    watchdog = ["--step-timeout", "2"]
    job.agent("a", steps=200, flags=watchdog, args=["1", "20"])
    job.agent("b", steps=200, flags=watchdog, args=["1", "20"])
    job.wait(lambda: _spare_ready(job, "a") and _spare_ready(job, "b"), "spares on both nodes")
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, (job.log("a"), job.log("b"))

    logs = job.log("a") + job.log("b")
    assert "did not leave its round; killing it" in logs, logs
    # faulthandler's dump of the hung rank: where it was stuck.
    assert re.search(r'File ".*inprocess_steps\.py", line \d+ in train', logs), logs
    first = {line["rank"]: line["pid"] for line in job.steps() if line["round"] == 1}
    later = [line for line in job.steps() if line["round"] > 1]
    final_round = max(line["round"] for line in later)
    final = {line["rank"]: line for line in later if line["round"] == final_round}
    assert final[0]["pid"] == first[0], "the rank waiting for its hung peer was killed too"
    assert final[1]["pid"] != first[1]
    for rank in (0, 1):
        steps = sorted(
            line["step"] for line in later if line["round"] == final_round and line["rank"] == rank
        )
        assert steps == list(range(200))
