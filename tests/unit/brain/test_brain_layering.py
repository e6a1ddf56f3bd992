"""The brain imports neither the master, the worker nor torch; its optimizer
imports no I/O library at all (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import dlfleet.brain.optimizer.planner
io = sorted(m for m in ("sqlalchemy", "grpc", "alembic") if m in sys.modules)
assert not io, f"the optimizer imported {io}"
import dlfleet.brain.api, dlfleet.brain.cli, dlfleet.brain.local, dlfleet.brain.client
import dlfleet.brain.reporter, dlfleet.brain.server
bad = sorted(m for m in sys.modules if m.split(".")[0] == "torch"
             or m.startswith(("dlfleet.master", "dlfleet.worker")))
assert not bad, f"the brain imported {bad}"
"""


def test_brain_layering() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
