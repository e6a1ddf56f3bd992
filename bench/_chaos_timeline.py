"""Time accounting for the chaos bench (bench/chaos.py), from the ledger of
tests/e2e/scripts/ledger_train.py: every line is one rank's step, stamped
with the wall-clock time `t` at which it was logged.

Step intervals. The lines of one rank in one attempt, in step order, tile
that rank's training time: line i covers [t_i, t_{i+1}). The last line of an
attempt has no successor (the attempt ended: finished, or a fault ended it),
so it covers one typical step, the median of all the intervals. An interval
longer than `STALL_FACTOR` typical steps is a stall inside the attempt (a
step waiting on a peer that is gone, on a master that is down): it covers one
typical step, and the rest is stalled time.

Over a window [lo, hi):
- busy time: the length of the union of every line's interval (some rank was
  in a step, counted or not);
- useful time: the same union over the lines of the final lineage only (the
  steps that the model that finished the job kept; see tests/e2e/ledger.py);
- stalled time: the window minus the busy time (no rank was in any step);
- goodput: useful time / window. The training window runs from the first
  step's line to the end of the last step's interval: the processes' start-up
  before the first step and the teardown after the last one are left out.

Pure functions: the bench's live view and its final report both use them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

STALL_FACTOR = 5.0  # an interval beyond this many typical steps is (mostly) a stall


@dataclass(frozen=True)
class StepLine:
    """One rank's step, as the chaos bench needs it."""

    attempt: int
    rank: int
    world: int
    step: int
    t: float
    counted: bool = True  # in the final lineage


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    counted: bool


def typical_step(lines: Iterable[StepLine]) -> float:
    """The median interval between consecutive lines of a rank in an attempt."""
    gaps = [b.t - a.t for a, b in _consecutive(lines) if b.t >= a.t]
    return statistics.median(gaps) if gaps else 0.0


def intervals(lines: Iterable[StepLine], typical: float | None = None) -> list[Interval]:
    """Each line's interval (see the module docstring)."""
    lines = list(lines)
    step = typical_step(lines) if typical is None else typical
    cap = STALL_FACTOR * step
    out: list[Interval] = []
    for stream in _streams(lines):
        for i, line in enumerate(stream):
            if i + 1 < len(stream):
                length = max(0.0, stream[i + 1].t - line.t)
                if length > cap:
                    length = step
            else:
                length = step
            out.append(Interval(line.t, line.t + length, line.counted))
    return out


def union_length(spans: Iterable[Interval], lo: float, hi: float) -> float:
    """The length of the union of `spans`, clipped to [lo, hi)."""
    clipped = sorted((max(s.start, lo), min(s.end, hi)) for s in spans)
    total = 0.0
    current_start, current_end = lo, lo
    for start, end in clipped:
        if end <= start:
            continue
        if start > current_end:
            total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    return total + current_end - current_start


@dataclass(frozen=True)
class Accounting:
    """The training window and how it was spent (seconds)."""

    start: float  # the first step's line
    end: float  # the end of the last step's interval
    typical_step: float
    busy: float
    useful: float

    @property
    def window(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def stalled(self) -> float:
        return max(0.0, self.window - self.busy)

    @property
    def lost_work(self) -> float:
        """Time in steps that a restore rolled back (and that nothing else covered)."""
        return max(0.0, self.busy - self.useful)

    @property
    def goodput(self) -> float:
        return self.useful / self.window if self.window > 0 else 0.0


def account(lines: Sequence[StepLine]) -> Accounting:
    if not lines:
        return Accounting(0.0, 0.0, 0.0, 0.0, 0.0)
    step = typical_step(lines)
    spans = intervals(lines, step)
    start = min(s.start for s in spans)
    end = max(s.end for s in spans)
    return Accounting(
        start=start,
        end=end,
        typical_step=step,
        busy=union_length(spans, start, end),
        useful=union_length([s for s in spans if s.counted], start, end),
    )


def stalled_between(spans: Sequence[Interval], lo: float, hi: float) -> float:
    """Seconds of [lo, hi) in which no rank was in any step."""
    if hi <= lo:
        return 0.0
    return max(0.0, (hi - lo) - union_length(spans, lo, hi))


def _streams(lines: Iterable[StepLine]) -> list[list[StepLine]]:
    by_stream: dict[tuple[int, int], list[StepLine]] = defaultdict(list)
    for line in lines:
        by_stream[(line.attempt, line.rank)].append(line)
    return [sorted(s, key=lambda x: (x.step, x.t)) for s in by_stream.values()]


def _consecutive(lines: Iterable[StepLine]) -> list[tuple[StepLine, StepLine]]:
    pairs: list[tuple[StepLine, StepLine]] = []
    for stream in _streams(lines):
        pairs.extend(pairwise(stream))
    return pairs
