"""Stragglers: in data-parallel training every step waits for the slowest
node, so one slow node slows the whole job. A node is a straggler when its
step time is above `slowdown` x the median of the other nodes in each of the
last `windows` windows of `window_s` seconds (ending now). A window where the
node or all the others reported nothing clears it: only a sustained, measured
slowness counts. Nodes replaced within the horizon are left alone while their
old samples age out.

The pre-flight node check is remembered: a node it passed but measured at
`suspect_slowdown` x the others or slower (its matmul or its all-reduce) is a
suspect, and for a suspect the newest `suspect_windows` windows are evidence
enough: what training shows confirms what the check saw."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.records import Decision, NodeCheckRecord, NodeSample, PlanKind


@dataclass(frozen=True)
class StragglerSettings:
    slowdown: float = 1.5
    windows: int = 3
    window_s: float = 30.0
    suspect_slowdown: float = 1.25
    suspect_windows: int = 1

    def __post_init__(self) -> None:
        if self.slowdown <= 1 or self.windows < 1 or self.window_s <= 0:
            raise InvalidArgument("straggler slowdown must be > 1, windows >= 1, window_s > 0")
        if self.suspect_slowdown <= 1 or not 1 <= self.suspect_windows <= self.windows:
            raise InvalidArgument(
                "straggler suspect_slowdown must be > 1 and suspect_windows in 1..windows"
            )

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


def suspects(checks: Mapping[str, NodeCheckRecord], settings: StragglerSettings) -> set[str]:
    """Nodes whose pre-flight check passed them but measured them slow."""
    return {
        node
        for node, check in checks.items()
        if not check.faulty and check.slowdown >= settings.suspect_slowdown
    }


def find_straggler(
    samples: Sequence[NodeSample],
    now_ms: int,
    settings: StragglerSettings,
    recently_replaced: Set[str] = frozenset(),
    checks: Mapping[str, NodeCheckRecord] | None = None,
) -> Decision | None:
    checks = checks or {}
    suspected = suspects(checks, settings)
    width = int(settings.window_s * 1000)
    ratios: dict[str, dict[int, float]] = defaultdict(dict)  # node -> window (0: newest) -> ratio
    medians: list[float] = []
    for j in range(settings.windows):
        end = now_ms - j * width
        steps = _window_steps(samples, end - width, end)
        for node, step in steps.items():
            others = [v for n, v in steps.items() if n != node]
            if others:
                ratios[node][j] = step / statistics.median(others)
        medians.append(statistics.median(steps.values()) if steps else 0.0)
    slow: dict[str, float] = {}
    for node, by_window in ratios.items():
        needed = settings.suspect_windows if node in suspected else settings.windows
        newest = [by_window.get(j) for j in range(needed)]
        if node in recently_replaced or any(r is None for r in newest):
            continue
        least = min(r for r in newest if r is not None)
        if least > settings.slowdown:
            slow[node] = least
    if not slow:
        return None
    # The check's suspects first: two kinds of evidence agree on them.
    node = max(slow, key=lambda n: (n in suspected, slow[n], n))
    needed = settings.suspect_windows if node in suspected else settings.windows
    windows = "window" if needed == 1 else f"{needed} windows"
    reason = (
        f"replace node {node}: its step time was at least {slow[node]:.2f} x the median of "
        f"the other nodes in each of the last {windows} of {settings.window_s:g} s "
        f"(limit {settings.slowdown:g} x)"
    )
    evidence: dict[str, Any] = {
        "node": node,
        "ratios_newest_first": [round(ratios[node][j], 3) for j in sorted(ratios[node])],
        "median_step_s_newest_first": [round(m, 4) for m in medians],
        "slowdown": settings.slowdown,
        "windows": needed,
        "window_s": settings.window_s,
        "others_slow": sorted(n for n in slow if n != node),
    }
    if node in suspected:
        check = checks[node]
        reason += (
            f"; its pre-flight check had already measured it at {check.slowdown:.2f} x the "
            f"other nodes (suspect from {settings.suspect_slowdown:g} x: one window confirms it)"
        )
        evidence["node_check"] = {
            "slowdown": round(check.slowdown, 3),
            "rule": check.rule,
            "at_ms": check.at_ms,
            "compute_ms": check.compute_ms,
            "compute_reference_ms": check.compute_reference_ms,
            "pair_ms": check.pair_ms,
            "pair_reference_ms": check.pair_reference_ms,
        }
    return Decision(PlanKind.REPLACE_NODE, reason, evidence, node=node)
