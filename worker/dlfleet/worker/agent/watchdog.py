"""How long a rank may go without a step before it counts as hung.

The agent's watchdog reads each rank's progress file (`dlfleet.worker.progress`)
every monitor interval. A fixed bound (`--step-timeout`) must allow for the
slowest step a job ever makes, so a job with 0.1 s steps and a 300 s bound
loses five minutes to every hang. With `--step-timeout-factor K` the bound is
learned instead, per rank and round, from the gaps between the rank's progress
writes: once `WARMUP_WRITES` writes have been seen, a rank is hung when its
file is older than K times the longest gap seen so far, never less than
`--step-timeout-min` (the floor) nor more than `--step-timeout` (the ceiling).
nvidia-resiliency-ext's fault tolerance computes its timeouts the same way
(the longest observed interval times a safety factor).

The gap between writes is what the file's age is compared with, not a step's
time: `progress.step()` writes at most every `progress.MIN_INTERVAL_S`, so a
healthy file grows up to that old between writes whatever the step time.
The longest gap only grows within a round, and a round starts learning
afresh (its first steps restore state, build the process group, warm up).
Time off the watch (`progress.idle()` removes the file: evaluation, the end of
an epoch) is not a gap: the next write starts a new one. Nor is a gap during
which the master was away (it restarts in a second or two, and saves and
leases may wait for it): that is not the job's pace, and learning it would
leave every later hang of the round to the ceiling. For a while after the
master was away (`CATCH_UP_S`) the learned bound does not judge either:
a save then waits for the master to commit its step and for the peer's
copy (the keeper's own bounds), which a 0.1 s step's learned bound would
call a hang; the ceiling still does.

Pure: the caller gives the file's modification times; tested by properties in
tests/unit/worker/test_watchdog.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlfleet.worker.agent.keeper import ANSWER_WAIT_S

WARMUP_WRITES = 8
DEFAULT_FLOOR_S = 2.0
# After the master was last seen away: a save's answer may wait ANSWER_WAIT_S
# (dlfleet.worker.agent.keeper) once the master answers again; a second for
# the reports to get through.
CATCH_UP_S = ANSWER_WAIT_S + 1.0


@dataclass(frozen=True)
class Bounds:
    """`ceiling`: the fixed bound, and the only one while learning (> 0).
    `factor`: 0 for a fixed bound, else the learned bound's multiple of the
    longest gap (>= 2: one gap is the file's normal age). `floor`: the least
    learned bound."""

    ceiling: float
    factor: float = 0.0
    floor: float = DEFAULT_FLOOR_S

    def __post_init__(self) -> None:
        if not self.ceiling > 0:
            raise ValueError(f"the step timeout must be > 0 s, got {self.ceiling}")
        if self.factor != 0 and not self.factor >= 2:
            raise ValueError(f"the step timeout factor must be 0 (off) or >= 2, got {self.factor}")
        if not 0 < self.floor <= self.ceiling:
            raise ValueError(
                f"the step timeout floor must be in (0, {self.ceiling:g}] s, got {self.floor}"
            )


class StepPace:
    """One rank's progress writes in one round, as the watchdog saw them."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.learned = 0  # gaps measured in the round
        self.longest = 0.0  # the longest of them, seconds
        self._last: float | None = None  # the file's mtime at the last write seen

    def saw(self, mtime: float | None, excused_at: float = float("-inf")) -> None:
        """The file's modification time now (None: no file, the rank is idle
        or has not started). `excused_at`: the last moment (same clock) the
        rank had a cause to wait that is not its own pace (the master was
        away); a gap that spans it is not learned."""
        if mtime is None:
            self._last = None
            return
        if mtime == self._last:
            return
        if self._last is not None and mtime > self._last and excused_at < self._last:
            self.longest = max(self.longest, mtime - self._last)
            self.learned += 1
        self._last = mtime

    def limit(self, since_master_away: float = float("inf")) -> float:
        """How old the file may grow before the rank counts as hung,
        `since_master_away` seconds after the master was last seen away."""
        b = self.bounds
        if b.factor == 0 or self.learned < WARMUP_WRITES or since_master_away < CATCH_UP_S:
            return b.ceiling
        return min(b.ceiling, max(b.floor, b.factor * self.longest))

    def learning(self) -> bool:
        return self.bounds.factor != 0 and self.learned < WARMUP_WRITES
