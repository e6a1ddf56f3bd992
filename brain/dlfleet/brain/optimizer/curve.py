"""A job's scaling curve: throughput as a function of the node count.

Measured sizes carry the median of their rounds (robust to a slow or a lucky
round). Unmeasured sizes get an optimistic estimate that assumes diminishing
returns (a concave curve):

- below the smallest measured size: linear through the origin;
- between two measured sizes a < n < b: the segment into `a` continued until it
  reaches the level of the higher of the two ("linear, then a knee, then flat"),
  or the straight line a-b when that is higher. Example: 4 nodes at 4/s and 8
  nodes at 6/s with a slope of 1/s per node into 4 put 5, 6, 7 nodes at 5, 6,
  6/s: the knee is expected at 6;
- above the largest measured size: its incoming slope continued.

Slopes are never negative (a measured drop means "no gain", not "a loss to
extrapolate") and never steeper than linear scaling from the reference.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dlfleet.brain.records import RoundMetrics


@dataclass(frozen=True)
class SizePoint:
    nodes: int
    samples_per_s: float  # the median over `rounds`
    rounds: int
    world_size: int


class Curve:
    def __init__(self, points: Mapping[int, SizePoint]) -> None:
        self._points = dict(sorted(points.items()))
        self.sizes: list[int] = list(self._points)

    @staticmethod
    def from_rounds(rounds: Iterable[RoundMetrics], min_duration_s: float = 0.0) -> Curve:
        """The rounds that lasted at least `min_duration_s`, by node count."""
        by_size: dict[int, list[RoundMetrics]] = defaultdict(list)
        for r in rounds:
            if r.duration_s >= min_duration_s and r.duration_s > 0:
                by_size[r.nodes].append(r)
        points = {
            n: SizePoint(
                nodes=n,
                samples_per_s=statistics.median(r.samples_per_s for r in rs),
                rounds=len(rs),
                world_size=max(r.world_size for r in rs),
            )
            for n, rs in by_size.items()
        }
        return Curve(points)

    def __bool__(self) -> bool:
        return bool(self._points)

    def point(self, nodes: int) -> SizePoint | None:
        return self._points.get(nodes)

    def measured(self, nodes: int) -> float | None:
        point = self._points.get(nodes)
        return None if point is None else point.samples_per_s

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    @property
    def reference(self) -> float:
        """Throughput per node at the smallest measured size: what one node is
        worth when it scales perfectly. Every share is a share of this."""
        smallest = self.sizes[0]
        return self._points[smallest].samples_per_s / smallest

    def efficiency(self, nodes: int) -> float:
        """Throughput at `nodes` against linear scaling from the smallest size."""
        ref = self.reference
        return self.estimate(nodes) / (nodes * ref) if ref > 0 else 0.0

    def slope_into(self, nodes: int) -> float:
        """Gain per node of the segment ending at the measured size `nodes`
        (the reference for the smallest size), within [0, reference]: a
        super-linear segment is noise to extrapolate from, not a promise."""
        index = self.sizes.index(nodes)
        if index == 0:
            return self.reference
        prev = self.sizes[index - 1]
        gain = self._points[nodes].samples_per_s - self._points[prev].samples_per_s
        return min(self.reference, max(0.0, gain / (nodes - prev)))

    def estimate(self, nodes: int) -> float:
        """Measured throughput at `nodes`, else the optimistic estimate of the
        module docstring."""
        exact = self.measured(nodes)
        if exact is not None:
            return exact
        if not self.sizes:
            raise ValueError("an empty curve has no estimate")
        if nodes < self.sizes[0]:
            return self.reference * nodes
        if nodes > self.largest:
            top = self.largest
            return self._points[top].samples_per_s + self.slope_into(top) * (nodes - top)
        below = max(n for n in self.sizes if n < nodes)
        above = min(n for n in self.sizes if n > nodes)
        t_a = self._points[below].samples_per_s
        t_b = self._points[above].samples_per_s
        knee = min(t_a + self.slope_into(below) * (nodes - below), max(t_a, t_b))
        straight = t_a + (t_b - t_a) * (nodes - below) / (above - below)
        return max(knee, straight)

    def table(self) -> dict[str, float]:
        """{nodes: samples/s} with string keys, for evidence (JSON)."""
        return {str(n): round(p.samples_per_s, 3) for n, p in self._points.items()}
