"""The trainers people use, under dlfleet through its integrations: a Hugging
Face `Trainer` (tiny GPT-2 from a config) with `DLFleetTrainer`, and a
Lightning module with Lightning's `DLFleetTrainer` (or, "lightning-adapters",
`pl.Trainer` with `DLFleetEnvironment` + `DLFleetCheckpoint`) and the
`ShardedDataLoader` (tests/e2e/scripts/{hf,lightning}_ledger_train.py).

Each logs the records every rank trained at every step; tests/e2e/ledger.py
checks that the model that survived trained every record of every epoch
exactly once.

- A worker killed mid-epoch: both ranks restore the newest step every rank
  saved, from memory (the step before the kill), not from the framework's
  own folders. Both `DLFleetTrainer`s restart in place: the surviving rank
  keeps its process and trains in the next round.
- A machine lost (every process of rank 1's host killed, tests/netns.py):
  the survivor trains alone in a world of one, from its own memory;
  Lightning's environment follows the round instead of refusing a world
  that is not `devices x num_nodes`. In place, the survivor persists
  nothing on its way to the next round (one Checkpointer for every round);
  with the adapters alone, stopped by its agent, rank 0 persists a step
  whole at once: the lost rank's part from the replica its machine sent,
  not waited for.
"""

from __future__ import annotations

import re
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import LedgerReport, assert_exactly_once, read_ledger
from harness import JobProcess
from netns import NetLab, Output, require_netns, user_env

from dlfleet.worker.checkpoint import persist

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORKS = {
    "hf": SCRIPTS / "hf_ledger_train.py",
    "lightning": SCRIPTS / "lightning_ledger_train.py",
}
SIZE = 203  # prime: no world size or batch divides it
EPOCHS = 2
TOKEN = secrets.token_hex(16)
HOSTS = {"m": "10.233.0.1", "a": "10.233.0.2", "b": "10.233.0.3"}


class FrameworkJob(JobProcess):
    def __init__(self, root: Path, framework: str, args: list[str]) -> None:
        root = root / framework
        root.mkdir()
        self.ledger = root / "ledger"
        super().__init__(
            root,
            {
                "name": f"{framework}-ledger",
                "command": str(FRAMEWORKS[framework]),
                "args": ["--ledger-dir", str(self.ledger), "--size", str(SIZE), *args],
                "nodes": {"min": 1, "max": 2},
                "display": "plain",
                "max_restarts": 3,
                "relaunch_delay_s": 0.5,
                "rendezvous": {"last_call_timeout_s": 0.5},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
                "node_check": {"enabled": False},
            },
        )

    def succeed(self) -> str:
        code, out, err = self.finish(timeout=200)
        assert code == 0, f"job failed ({code}):\n{err[-4000:]}\n{out[-4000:]}"
        return out + err


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[FrameworkJob] = []

    def make(framework: str, args: list[str]) -> FrameworkJob:
        job = FrameworkJob(tmp_path, framework, args)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


def restored_steps(report: LedgerReport) -> list[int]:
    """The steps the attempts after the first restored."""
    return [r.restored_step for r in report.restores if r.attempt > report.restores[0].attempt]


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_worker_killed_restores_the_step_before_from_memory_and_trains_every_record_once(
    make_job: Any, framework: str
) -> None:
    args = ["--crash-at-step", "17", "--crash-rank", "1", "--dlfleet-save-every", "1"]
    if framework == "lightning":
        # dlfleet's own persisted copies too: its Checkpointer, one for every
        # round, persists nothing as the survivor leaves the round in place
        # (closed per round, it waited there for the dead rank's part and the
        # agent took the survivor for hung).
        args += ["--dlfleet-persist-every", "1000", "--dlfleet-persist-dir", "disk"]
    job = make_job(framework, args).start()
    log = job.succeed()
    report = assert_exactly_once(job.ledger, size=SIZE, epochs=EPOCHS)
    # Every step was checkpointed: the restart lost the step being trained,
    # and at most the one before it, whose image the killed rank may still
    # have been finishing in the background (its save had returned; step 15
    # was committed before it did, since a save waits for the step before).
    (restored,) = restored_steps(report)
    assert restored in (15, 16), report.restores
    assert f"resumed at step {restored} from memory" in log, log[-3000:]
    # Restarted in place: the survivor kept its process.
    assert "round 1 aborted" in log and "waiting for the next round" in log, log[-3000:]


# ------------------------------------------------------- a machine lost


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    require_netns()
    net = NetLab(dict(HOSTS)).start()
    try:
        yield net
    finally:
        net.close()


def steps_logged(ledger: Path) -> int:
    return len(read_ledger(ledger)[0]) if ledger.exists() else 0


def rank0_steps(ledger: Path) -> int:
    return sum(1 for entry in read_ledger(ledger)[0] if entry.rank == 0)


def wait_steps(ledger: Path, count: int, timeout: float, *outputs: Output) -> None:
    deadline = time.monotonic() + timeout
    while steps_logged(ledger) < count:
        ended = [o.name for o in outputs if o.proc.poll() is not None]
        if time.monotonic() > deadline or ended:
            tails = "\n\n".join(f"{o.name}:\n{o.tail()}" for o in outputs)
            why = f"{', '.join(ended)} ended" if ended else f"not in {timeout}s"
            raise AssertionError(f"fewer than {count} steps logged: {why}\n{tails}")
        time.sleep(0.05)


@pytest.mark.parametrize("framework", [*sorted(FRAMEWORKS), "lightning-adapters"])
def test_a_lost_machine_leaves_its_peer_training_alone_from_memory_exactly_once(
    lab: NetLab, framework: str
) -> None:
    job = lab.shared / secrets.token_hex(4)
    job.mkdir()
    ledger, disk = job / "ledger", job / "disk"
    env = user_env(DLFLEET_TOKEN=TOKEN)
    bin_dir = Path(sys.executable).parent
    serve = [
        str(bin_dir / "dlmaster"), "--host", "0.0.0.0", "--port", "50051",
        "--min-nodes", "1", "--max-nodes", "2", "--last-call-timeout", "1",
    ]  # fmt: skip
    try:
        master = Output("dlmaster", lab.popen("m", serve, env, cwd=str(job)))
        master.wait_for(r"listening on", timeout=60)
        worker = [
            str(bin_dir / "dlworker"), "--master", "hostm:50051", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--max-restarts", "3",
            str(FRAMEWORKS[framework.split("-", maxsplit=1)[0]]), "--ledger-dir", str(ledger),
            "--size", str(SIZE),
            "--sleep-per-step", "0.1", "--dlfleet-save-every", "1",
        ]  # fmt: skip
        if framework.startswith("lightning"):  # with dlfleet's persisted copies
            worker += ["--dlfleet-persist-every", "1000", "--dlfleet-persist-dir", str(disk)]
        if framework == "lightning-adapters":  # restarted cold: it persists on SIGTERM
            worker += ["--adapters"]
        nodes = {host: Output(f"node {host}", lab.popen(host, worker, env)) for host in "ab"}
        wait_steps(ledger, 2 * 12, 150, master, *nodes.values())
        # The machine of rank 1 is lost; rank 0's survives. Lost just as rank
        # 0 begins a step (its ledger line comes before the step's sleep): its
        # agent stops it before its next collective could fail on the dead peer.
        first = {
            h: n.wait_for(r"round 1: group rank (\d)", timeout=10)[1] for h, n in nodes.items()
        }
        lost, kept = sorted(nodes, key=lambda h: first[h].group(1) == "0")
        begun = rank0_steps(ledger)
        while rank0_steps(ledger) == begun:
            time.sleep(0.005)
        lab.kill_host(lost)
        assert nodes[kept].wait_exit(180) == 0, nodes[kept].tail(60)
    finally:
        lab.kill_processes()
    report = assert_exactly_once(ledger, size=SIZE, epochs=EPOCHS)
    worlds = [entry.world for entry in read_ledger(ledger)[0]]
    assert worlds[0] == 2 and worlds[-1] == 1, sorted(set(worlds))
    # From the survivor's own memory: a recent step, not the start.
    assert min(restored_steps(report)) >= 10, report.restores
    survivor = nodes[kept].text()
    assert "from memory" in survivor, nodes[kept].tail(60)
    if framework in ("hf", "lightning"):  # restarted in place, no persist on the way
        assert "round 1 aborted" in survivor and "waiting for the next round" in survivor
    if framework == "lightning":
        # Its one Checkpointer for every round persisted the last step as
        # the job ended.
        newest = persist.newest_persisted(disk)
        assert newest is not None, sorted(disk.iterdir())
        persist.verify_folder(newest[1])
    if framework == "lightning-adapters":
        # Stopped by its agent, rank 0 persisted a step whole at once (the
        # newest held whole: it writes its part of each step it holds): rank
        # 1's part from the replica its machine had sent, not waited for.
        written = re.search(
            r"rank 1 is gone; writing its part of step (\d+) from its replica", survivor
        )
        assert written is not None, nodes[kept].tail(60)
        assert f"terminated: persisted step {written.group(1)} first" in survivor, survivor[-3000:]
        step = int(written.group(1))
        folder = persist.step_folder(disk, step)
        assert (folder / persist.MANIFEST).is_file(), sorted(disk.iterdir())
        persist.verify_folder(folder)
        # The Lightning checkpoint of that step, as dlfleet's integration saves it.
        assert persist.load_persisted_full(folder)["lightning"]["global_step"] == step
