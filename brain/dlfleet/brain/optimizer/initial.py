"""The initial plan of a new job: how many nodes, and how much memory and CPU
per node, from earlier runs of the same kind of job (same signature).

The node count is the one that gave the most throughput among the sizes whose
efficiency reached `efficiency_threshold`; efficiency(n) = throughput(n) /
(n x throughput per node at the smallest size measured), the sizes pooled over
every earlier run (median per size). Memory and CPU are the peaks those runs
used, with a margin. Without history, the job's own config. Always clamped to
the job's min..max.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.optimizer.curve import Curve
from dlfleet.brain.records import Decision, JobInfo, PlanKind, RoundMetrics

MIB = 1 << 20


@dataclass(frozen=True)
class InitialSettings:
    efficiency_threshold: float = 0.7
    memory_margin: float = 1.25  # over the peak RSS of earlier runs
    cpu_margin: float = 1.25  # over their peak CPU use
    min_round_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.efficiency_threshold <= 1:
            raise InvalidArgument("efficiency_threshold must lie in (0, 1]")
        if self.memory_margin < 1 or self.cpu_margin < 1:
            raise InvalidArgument("memory_margin and cpu_margin must be >= 1")


@dataclass(frozen=True)
class JobHistory:
    """What one earlier run of the same signature measured."""

    name: str
    rounds: Sequence[RoundMetrics]
    peak_rss_bytes: int = 0  # 0: not measured
    peak_cpu_percent: float = 0.0
    ooms: int = 0


def round_up(value: float, unit: int) -> int:
    return math.ceil(value / unit) * unit


def initial_plan(
    job: JobInfo, history: Sequence[JobHistory], settings: InitialSettings
) -> Decision:
    if not history:
        return Decision(
            PlanKind.INITIAL,
            f"start at {job.start_nodes} nodes with the job's config: no earlier run of "
            f"signature {job.signature!r}",
            {"signature": job.signature, "history": []},
            target_nodes=job.start_nodes,
            memory_bytes=job.memory_request_bytes,
            cpu=job.cpu_request,
        )
    curve = Curve.from_rounds([r for past in history for r in past.rounds], settings.min_round_s)
    evidence: dict[str, Any] = {
        "signature": job.signature,
        "history": [past.name for past in history],
        "efficiency_threshold": settings.efficiency_threshold,
    }
    parts: list[str] = []
    nodes = job.start_nodes
    if curve and curve.reference > 0:
        efficient = [n for n in curve.sizes if curve.efficiency(n) >= settings.efficiency_threshold]
        best = max(efficient, key=lambda n: (curve.estimate(n), -n))
        nodes = min(max(best, job.min_nodes), job.max_nodes)
        evidence["throughput"] = curve.table()
        evidence["efficiency"] = {str(n): round(curve.efficiency(n), 3) for n in curve.sizes}
        evidence["best_nodes"] = best
        parts.append(
            f"{best} nodes gave {curve.estimate(best):.1f} samples/s at efficiency "
            f"{curve.efficiency(best):.2f} (>= {settings.efficiency_threshold:.2f})"
            + (
                f", clamped to {nodes} by the job's {job.min_nodes}..{job.max_nodes}"
                if nodes != best
                else ""
            )
        )
    else:
        parts.append(f"no round long enough to measure: {nodes} nodes from the job's config")
    memory, cpu = job.memory_request_bytes, job.cpu_request
    peak_rss = max(past.peak_rss_bytes for past in history)
    if peak_rss > 0:
        memory = round_up(peak_rss * settings.memory_margin, MIB)
        evidence["peak_rss_bytes"] = peak_rss
        parts.append(
            f"memory {memory // MIB} MiB = peak RSS {peak_rss // MIB} MiB x "
            f"{settings.memory_margin}"
        )
    peak_cpu = max(past.peak_cpu_percent for past in history)
    if peak_cpu > 0:
        cpu = math.ceil(peak_cpu / 100 * settings.cpu_margin * 10) / 10
        evidence["peak_cpu_percent"] = peak_cpu
        parts.append(f"CPU {cpu:g} cores = peak {peak_cpu:.0f}% x {settings.cpu_margin}")
    ooms = sum(past.ooms for past in history)
    if ooms:
        evidence["ooms"] = ooms
        parts.append(f"{ooms} OOM kill(s) in those runs")
    runs = len(history)
    return Decision(
        PlanKind.INITIAL,
        f"start at {nodes} nodes from {runs} earlier run(s) of signature "
        f"{job.signature!r}: " + "; ".join(parts),
        evidence,
        target_nodes=nodes,
        memory_bytes=memory,
        cpu=cpu,
    )
