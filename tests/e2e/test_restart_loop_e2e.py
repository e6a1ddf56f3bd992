"""The restart-loop breaker end to end: a real `dlmaster --job-config` job
whose script fails one step after every restore (scripts/restart_loop_steps.py).
The breaker steps the restores down the held steps, two failures per step
(`restart_loop.failures: 2`), and when none older is left the job fails with
the diagnosis as its root cause, after a bounded count of restarts.

About 30 s on a 2-core machine: one node of one rank."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import JobProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

SCRIPT = Path(__file__).parent / "scripts" / "restart_loop_steps.py"
FAIL_AT = 2  # a fresh start saves steps 0 and 1, then fails


@pytest.fixture
def job(tmp_path: Path) -> Iterator[JobProcess]:
    out = tmp_path / "out"
    out.mkdir()
    job = JobProcess(
        tmp_path,
        {
            "name": "loop",
            "command": str(SCRIPT),
            "args": [str(out), str(FAIL_AT)],
            "nodes": {"min": 1, "max": 1},
            "display": "plain",
            "max_restarts": 20,  # the breaker, not the restart budget, ends it
            "restart_loop": {"failures": 2, "window": 1},
            "rendezvous": {"last_call_timeout_s": 0.2},
            "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
            "node_check": {"enabled": False},
        },
    )
    yield job
    job.kill()


def test_failing_after_every_restore_steps_down_then_fails_with_the_diagnosis(
    job: JobProcess, tmp_path: Path
) -> None:
    started = time.monotonic()
    code, out, err = job.start().finish(timeout=80)
    elapsed = time.monotonic() - started
    lines = (tmp_path / "out" / "restores.jsonl").read_text().splitlines()
    restores = [json.loads(line)["restored"] for line in lines]
    assert code != 0, f"the job should have failed:\n{err[-4000:]}"
    # A fresh start (which progressed: no strike), then two restores of each
    # held step, newest first, and no more: the breaker ended the loop.
    assert restores == [-1, 1, 1, 0, 0], restores
    # The root cause is the breaker's diagnosis: the node is not relaunched
    # into the same refusal.
    cause = err[err.rindex("FAILED:") :]
    assert "rule restart-loop" in cause, err[-4000:]
    assert re.search(r"failed 2 times after restoring step 0 \(rounds \d+, \d+\)", cause)
    assert "loss is NaN at step 1" in cause
    assert "was lost" not in out + err
    assert elapsed < 90
