"""The brain end to end on the local platform: a job whose steps model a
shared bottleneck (throughput stops growing past 2 ranks) starts with 1 node
of at most 4; the in-process brain measures each size, scales it up while a
node adds enough, finds that 4 did not, settles at the knee, and the ledger
is exact. A brain that is down does not slow or stop the job."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import assert_exactly_once, read_ledger
from harness import JobProcess

from dlfleet.brain.local import LocalBrain
from dlfleet.brain.records import PlanKind

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "ledger_train.py"
BATCH, EPOCHS = 4, 2


class BrainJob(JobProcess):
    def __init__(self, root: Path, size: int, args: list[str], **settings: Any) -> None:
        root.mkdir(parents=True)
        self.ledger = root / "ledger"
        self.size = size
        super().__init__(
            root,
            {
                "name": "brainy",
                "command": str(SCRIPT),
                "args": ["--ledger-dir", str(self.ledger), "--size", str(size),
                         "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
                         "--checkpoint-every", "10", *args],
                "display": "plain",
                "relaunch_delay_s": 0.5,
                "rendezvous": {"last_call_timeout_s": 0.5},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
                # Scaled-in nodes would check themselves first, their helper
                # pairs running beside the training whose throughput the
                # brain measures here (tests/e2e/test_node_check_e2e.py tests it).
                "node_check": {"enabled": False},
                **settings,
            },
        )  # fmt: skip

    def worlds(self) -> list[int]:
        entries, _, _ = read_ledger(self.ledger)
        by_attempt = {e.attempt: e.world for e in entries}
        return [by_attempt[a] for a in sorted(by_attempt)]

    def succeed(self, timeout: float = 240) -> str:
        code, out, err = self.finish(timeout=timeout)
        assert code == 0, f"job failed ({code}):\n{err[-4000:]}\n{out[-4000:]}"
        return out + err


def test_the_brain_scales_a_job_to_its_knee_and_stays(tmp_path: Path) -> None:
    job = BrainJob(
        tmp_path / "job", 4001, ["--sleep-per-step", "0.05", "--knee", "2"],
        nodes={"min": 1, "max": 4, "initial": 1},
        brain={"mode": "auto", "min_round_s": 5, "plan_interval_s": 1},
    )  # fmt: skip
    job.start()
    output = job.succeed()
    assert_exactly_once(job.ledger, size=job.size, epochs=EPOCHS)

    work = tmp_path / "job" / ".dlfleet"
    run = "brainy-" + (work / "brainy" / "brain-run").read_text().strip()
    brain = LocalBrain.open(f"sqlite:///{work / 'brain.db'}")
    try:
        report = brain.report(run)
    finally:
        brain.close()
    scales = [
        (p.current_nodes, p.target_nodes)
        for p in report.plans
        if p.kind is PlanKind.SCALE and p.applied
    ]
    print("plans:", *report.plans, "sizes:", *report.sizes, sep="\n  ")
    # Up while a node adds enough (1 -> 2 is linear), 4 found not worth it,
    # back to the knee; never back and forth.
    assert scales[0] == (1, 2), scales
    assert max(t for _, t in scales) > 2, scales  # it measured beyond the knee...
    assert scales[-1][1] == 2, scales  # ...and settled at it
    assert len(scales) <= 3, scales
    assert job.worlds()[0] == 1 and job.worlds()[-1] == 2, job.worlds()
    assert "brain plan" in output


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_brain_that_is_down_neither_slows_nor_stops_the_job(tmp_path: Path) -> None:
    """The same job twice: with the in-process brain, and pointed at a dlbrain
    service that is not there (every plan and every metric fails). The job
    succeeds with exact data and takes no longer (within noise)."""
    args = ["--sleep-per-step", "0.02"]
    times = {}
    for name, brain in {
        "up": {"mode": "auto", "plan_interval_s": 1},
        "down": {"mode": "auto", "plan_interval_s": 1, "address": f"127.0.0.1:{_closed_port()}"},
    }.items():
        job = BrainJob(tmp_path / name, 603, args, nodes={"min": 1, "max": 2}, brain=brain)
        started = time.monotonic()
        job.start()
        output = job.succeed()
        times[name] = time.monotonic() - started
        assert_exactly_once(job.ledger, size=job.size, epochs=EPOCHS)
        if name == "down":
            assert "brain: no plan" in output or "brain: no answer" in output, output[-3000:]
    print(f"job with the brain up {times['up']:.1f}s, down {times['down']:.1f}s")
    assert times["down"] <= times["up"] * 1.3 + 5, times


def test_a_job_reports_to_a_standalone_dlbrain_service(tmp_path: Path) -> None:
    """`dlbrain --db URL --port P` as its own process; job.yaml points the
    master at it; the run's rounds and plans land in that database."""
    port = _closed_port()
    (tmp_path / "brain.token").write_text("brain-token-0123456789\n")
    db = f"sqlite:///{tmp_path / 'service.db'}"
    service = subprocess.Popen(
        [sys.executable, "-m", "dlfleet.brain.cli", "--db", db, "--port", str(port),
         "--token-file", str(tmp_path / "brain.token")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # A service is up before the jobs that use it: the master asks for its
        # initial plan once, at the start (a brain that is not there yet is a
        # brain that is down, and the job goes on without that plan).
        assert service.stdout is not None
        said = [service.stdout.readline()]
        while said[-1] and "listening on" not in said[-1]:
            said.append(service.stdout.readline())
        assert "listening on" in said[-1], "".join(said)
        job = BrainJob(
            tmp_path / "job", 603, ["--sleep-per-step", "0.03"],
            nodes={"min": 1, "max": 2},
            brain={"mode": "advise", "plan_interval_s": 1, "address": f"127.0.0.1:{port}",
                   "token_file": str(tmp_path / "brain.token")},
        )  # fmt: skip
        job.start()
        job.succeed()
    finally:
        service.terminate()
        out, _ = service.communicate(timeout=20)
    run = "brainy-" + (tmp_path / "job" / ".dlfleet" / "brainy" / "brain-run").read_text().strip()
    brain = LocalBrain.open(db)
    try:
        report = brain.report(run)
    finally:
        brain.close()
    assert report.job.status.value == "succeeded", out
    assert [s.nodes for s in report.sizes] == [2], report.sizes
    assert report.plans and report.plans[0].kind is PlanKind.INITIAL
