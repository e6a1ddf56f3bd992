"""A preempted training process (SIGTERM) persists its newest in-memory step
before it exits, so a job stopped everywhere loses nothing it had saved."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dlfleet.worker.checkpoint import persist

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    for step in range(1, 4):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    print("saved", flush=True)
    time.sleep(60)
    """
)


def test_a_terminated_process_persists_its_newest_step_first(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "disk")],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DLFLEET_WORKDIR": str(tmp_path)},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while proc.stdout.readline().strip() != "saved":
        assert time.monotonic() < deadline and proc.poll() is None, "the script did not save"
    assert persist.newest_persisted(tmp_path / "disk") is None  # nothing was due yet
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    newest = persist.newest_persisted(tmp_path / "disk")
    assert newest is not None and newest[0] == 3
    assert persist.load_persisted_full(newest[1])["step"] == 3
