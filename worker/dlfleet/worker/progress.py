"""Step progress, from a training process to its agent: the watchdog's input.

The agent gives each worker a file (`$DLFLEET_PROGRESS_FILE`); `step()`
writes the process's step and sample counts into it, with when it wrote them
(`"<steps> <samples> <time.monotonic()> <blocked_s> <trained_step> <since> <ended>"`,
`since` the time of the first step of the current run of steps: since the
process started or was last idle; `ended` the time of the previous run's last
step, before it went idle (0: none); a clock
the agent on the same host shares), at most every `MIN_INTERVAL_S` (the first
two steps at once), which also sets its modification time. Rates are taken
between the writes' own times, not the agent's reads: a read lags its write
by up to `MIN_INTERVAL_S`, which over a heartbeat of a second would make a
steady rate read 90% to 110% of itself. The agent's `--step-timeout`
watchdog restarts the workers when a rank that has stepped at least once has
not stepped for that long: a silent hang (a collective waiting forever, a
deadlocked data pipeline) becomes a failure.
The counts give the node's step time and samples/s, which the agent sends
the master with its heartbeats (for the brain and the status display).

`saved()`, called by the Checkpointer after each save, adds the time the
save kept the step waiting to the file's `blocked_s` (the job's goodput counts
it as checkpoint blocking) and ties the process's step count to the training
step it saved, so that `trained_step` says which step the process is at (-1
before its first save): the master needs it to know how many steps a restore
rolls back, which a count since the process started cannot tell. Readers
take the first two or three fields of a file of an older form.

`idle()` takes the rank off the watch until its next `step()`: between
epochs, for evaluation, a final checkpoint, or the process's teardown, which
are not steps and may take longer than one.

`ShardedDataLoader` calls `announce()` when it is made, `step()` for every
batch it hands out and `idle()`
when an epoch's iteration ends; a script with another loader can call them
itself. Without the variable (no agent), both do nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

from dlfleet.api.env import PROGRESS_ENV

# A write costs tens of microseconds; ten a second keep the gap the step
# watchdog learns close to a step's time (a 0.1 s step: writes 0.1-0.2 s
# apart), so a learned bound catches a hang in about a second, not in a few.
MIN_INTERVAL_S = 0.1
# The first steps are written at once: whether a rank got past its first step
# decides how its failure is diagnosed (an error before it is the script's).
FIRST_STEPS_WRITTEN = 2


class Counts(NamedTuple):
    """A progress file's content: steps and samples since the process
    started, and when they were written (time.monotonic(); None in a file of
    an older form)."""

    steps: int
    samples: int
    at: float | None = None
    blocked_s: float = 0.0
    trained_step: int | None = None  # None: not known (no save yet)
    since: float | None = None  # the current run of steps began (None: not said)
    # The previous run's last step (None: none, or not said): when a process
    # that lived through an interruption stopped stepping before it.
    ended: float | None = None


_last = [0.0]  # when step() last wrote the file (monotonic)
_counts = [0, 0]  # steps, samples since the process started
_blocked_s = [0.0]  # time saves kept this process's steps waiting
_since = [0.0]  # the first step since the process started or was idle (0: none yet)
_stepped = [0.0]  # the last step (0: none yet)
_ended = [0.0]  # the last step before the process was last idle (0: never idle after a step)
# The training step minus the step count at the last save (None: no save yet).
_step_offset: list[int | None] = [None]


def step(samples: int = 0) -> None:
    """Tell the agent this process made a training step of `samples` records."""
    _counts[0] += 1
    _counts[1] += samples
    # The clock first: this runs on every training step, and most calls
    # write nothing (reading the environment costs more than the clock).
    now = _stepped[0] = time.monotonic()
    if not _since[0]:
        _since[0] = now
    elif now - _last[0] < MIN_INTERVAL_S and _counts[0] > FIRST_STEPS_WRITTEN:
        return
    _last[0] = now
    _write(now)


def _write(now: float) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    try:  # whole or not at all: the agent reads it at any moment
        with open(path + ".tmp", "w") as out:
            out.write(_line(now))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a progress signal must never break training


def _line(now: float) -> str:
    offset = _step_offset[0]
    trained = -1 if offset is None else _counts[0] + offset
    return (
        f"{_counts[0]} {_counts[1]} {now:.6f} {_blocked_s[0]:.6f} {trained} "
        f"{_since[0]:.6f} {_ended[0]:.6f}\n"
    )


def saved(step: int, blocked_s: float) -> None:
    """Tell the agent this process saved a checkpoint of training step
    `step`, which kept its training waiting `blocked_s`. Written with the
    next step's write, not here: a save may come every step."""
    _blocked_s[0] += max(0.0, blocked_s)
    _step_offset[0] = step - _counts[0]


def announce() -> None:
    """Tell the agent this process reports its steps, none yet (a file of
    "0 0"): a failure before the first step is then known as such. The
    watchdog starts timing at the first step, not here."""
    if _counts[0] == 0:
        _write(time.monotonic())


def read_counts(path: str) -> Counts | None:
    """The counts in a progress file; None if absent or unreadable."""
    try:
        with open(path) as source:
            fields = source.read().split()
        if len(fields) == 2:
            return Counts(int(fields[0]), int(fields[1]))
        if len(fields) == 3:
            return Counts(int(fields[0]), int(fields[1]), float(fields[2]))
        steps, samples, at, blocked, trained, *rest = fields
        step = int(trained)
        since, ended = (
            float(rest[i]) if len(rest) > i and float(rest[i]) > 0 else None for i in (0, 1)
        )
        return Counts(
            int(steps),
            int(samples),
            float(at),
            float(blocked),
            step if step >= 0 else None,
            since,
            ended,
        )
    except (OSError, ValueError):
        return None


def idle() -> None:
    """Tell the agent this process is not stepping now (not a hang). The next
    run's writes say when this run made its last step."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    if _since[0]:
        _ended[0] = _stepped[0]
    _last[0] = _since[0] = 0.0
    with contextlib.suppress(OSError):
        os.unlink(path)
