"""Step progress, from a training process to its agent: the watchdog's input.

The agent gives each worker a file (`$DLFLEET_PROGRESS_FILE`); `step()` sets
its modification time to now, at most every `MIN_INTERVAL_S`. The agent's
`--step-timeout` watchdog restarts the workers when a rank that has stepped
at least once has not stepped for that long: a silent hang (a collective
waiting forever, a deadlocked data pipeline) becomes a failure.

`idle()` takes the rank off the watch until its next `step()`: between
epochs, for evaluation, a final checkpoint, or the process's teardown, which
are not steps and may take longer than one.

`ShardedDataLoader` calls `step()` for every batch it hands out and `idle()`
when an epoch's iteration ends; a script with another loader can call them
itself. Without the variable (no agent), both do nothing.
"""

from __future__ import annotations

import contextlib
import os
import time

PROGRESS_ENV = "DLFLEET_PROGRESS_FILE"
MIN_INTERVAL_S = 0.5

_last = [0.0]  # when step() last touched the file (monotonic)


def step() -> None:
    """Tell the agent this process made a training step."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    now = time.monotonic()
    if now - _last[0] < MIN_INTERVAL_S:
        return
    _last[0] = now
    try:
        with open(path, "a"):
            os.utime(path)
    except OSError:
        pass  # a progress signal must never break training


def idle() -> None:
    """Tell the agent this process is not stepping now (not a hang)."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    _last[0] = 0.0
    with contextlib.suppress(OSError):
        os.unlink(path)
