"""Stragglers: in data-parallel training every step waits for the slowest
node, so one slow node slows the whole job. A node is a straggler when its
step time is above `slowdown` x the median of the other nodes in each of the
last `windows` windows of `window_s` seconds (ending now). A window where the
node or all the others reported nothing clears it: only a sustained, measured
slowness counts. Nodes replaced within the horizon are left alone while their
old samples age out."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence, Set
from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.records import Decision, NodeSample, PlanKind


@dataclass(frozen=True)
class StragglerSettings:
    slowdown: float = 1.5
    windows: int = 3
    window_s: float = 30.0

    def __post_init__(self) -> None:
        if self.slowdown <= 1 or self.windows < 1 or self.window_s <= 0:
            raise InvalidArgument("straggler slowdown must be > 1, windows >= 1, window_s > 0")

    @property
    def horizon_ms(self) -> int:
        return int(self.windows * self.window_s * 1000)


def _window_steps(samples: Sequence[NodeSample], start_ms: int, end_ms: int) -> dict[str, float]:
    """Each node's median step time over [start, end)."""
    steps: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        if start_ms <= s.at_ms < end_ms and s.step_time_s > 0:
            steps[s.node].append(s.step_time_s)
    return {node: statistics.median(values) for node, values in steps.items()}


def find_straggler(
    samples: Sequence[NodeSample],
    now_ms: int,
    settings: StragglerSettings,
    recently_replaced: Set[str] = frozenset(),
) -> Decision | None:
    width = int(settings.window_s * 1000)
    ratios: dict[str, list[float]] = defaultdict(list)
    medians: list[float] = []
    for j in range(settings.windows):
        end = now_ms - j * width
        steps = _window_steps(samples, end - width, end)
        for node, step in steps.items():
            others = [v for n, v in steps.items() if n != node]
            if others:
                ratios[node].append(step / statistics.median(others))
        medians.append(statistics.median(steps.values()) if steps else 0.0)
    slow = {
        node: min(rs)
        for node, rs in ratios.items()
        if len(rs) == settings.windows
        and min(rs) > settings.slowdown
        and node not in recently_replaced
    }
    if not slow:
        return None
    node = max(slow, key=lambda n: (slow[n], n))
    return Decision(
        PlanKind.REPLACE_NODE,
        f"replace node {node}: its step time was at least {slow[node]:.2f} x the median of "
        f"the other nodes in each of the last {settings.windows} windows of "
        f"{settings.window_s:g} s (limit {settings.slowdown:g} x)",
        {
            "node": node,
            "ratios_newest_first": [round(r, 3) for r in ratios[node]],
            "median_step_s_newest_first": [round(m, 4) for m in medians],
            "slowdown": settings.slowdown,
            "windows": settings.windows,
            "window_s": settings.window_s,
            "others_slow": sorted(n for n in slow if n != node),
        },
        node=node,
    )
