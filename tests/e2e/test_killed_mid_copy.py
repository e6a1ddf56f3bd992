"""A rank killed while its save's overlapped copy is under way: the restart
restores the previous committed step, whole, never the half-copied one
(scripts/killed_mid_copy.py). A real `dlmaster --job-config` job, one node
of one rank; about 20 s on a 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import JobProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).parent / "scripts" / "killed_mid_copy.py"
KILL_AT, LAST = 3, 5


def test_a_rank_killed_mid_copy_restores_the_previous_committed_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = JobProcess(
        tmp_path,
        {
            "name": "midcopy",
            "command": str(SCRIPT),
            "args": [str(out), str(KILL_AT), str(LAST)],
            "nodes": {"min": 1, "max": 1},
            "display": "plain",
            "max_restarts": 2,
            "rendezvous": {"last_call_timeout_s": 0.2},
            "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
            "node_check": {"enabled": False},
        },
    )
    try:
        code, stdout, err = job.start().finish(timeout=100)
    finally:
        job.kill()
    assert code == 0, f"{err[-4000:]}\n{stdout[-2000:]}"
    killed = json.loads((out / "killed.json").read_text())
    assert killed == {"unfinished": True}, "the kill came after the image was finished"
    restores = [json.loads(line) for line in (out / "restores.jsonl").read_text().splitlines()]
    # Step KILL_AT - 1 was committed before save(KILL_AT) began; the image of
    # KILL_AT never got its header. The restored weight is one value: whole.
    assert restores == [{"restored": KILL_AT - 1, "values": [float(KILL_AT)]}], restores
