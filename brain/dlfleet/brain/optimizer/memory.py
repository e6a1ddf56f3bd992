"""How much memory a node relaunched after an OOM kill asks for:
max(peak RSS observed x margin, the limit it was killed at x factor), rounded
up to a MiB and capped at `max_bytes`. Both terms matter: RSS samples miss the
spike that killed the node, and a limit far above what was ever seen means
the spike is larger than any sample."""

from __future__ import annotations

from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.optimizer.initial import MIB, round_up
from dlfleet.brain.records import Decision, OomRelaunch, PlanKind

GIB = 1 << 30


@dataclass(frozen=True)
class MemorySettings:
    margin: float = 1.2
    factor: float = 1.5
    max_bytes: int = 256 * GIB

    def __post_init__(self) -> None:
        if self.margin < 1 or self.factor < 1 or self.max_bytes <= 0:
            raise InvalidArgument("memory margin and factor must be >= 1, max_bytes > 0")


def memory_after_oom(
    relaunch: OomRelaunch, peak_rss_bytes: int, settings: MemorySettings
) -> Decision:
    limit = relaunch.memory_limit_bytes
    evidence = {
        "node": relaunch.node,
        "limit_bytes": limit,
        "peak_rss_bytes": peak_rss_bytes,
        "margin": settings.margin,
        "factor": settings.factor,
        "max_bytes": settings.max_bytes,
    }
    if limit <= 0 and peak_rss_bytes <= 0:
        return Decision(
            PlanKind.NONE,
            f"node {relaunch.node} was OOM-killed, but neither its limit nor its RSS is known",
            evidence,
        )
    by_peak = round_up(peak_rss_bytes * settings.margin, MIB)
    by_limit = round_up(limit * settings.factor, MIB)
    wanted = max(by_peak, by_limit)
    memory = min(wanted, settings.max_bytes)
    basis = (
        f"peak RSS {peak_rss_bytes // MIB} MiB x {settings.margin}"
        if by_peak >= by_limit
        else f"limit {limit // MIB} MiB x {settings.factor}"
    )
    capped = f", capped at {settings.max_bytes // MIB} MiB" if memory < wanted else ""
    return Decision(
        PlanKind.MEMORY,
        f"relaunch node {relaunch.node} with {memory // MIB} MiB after an OOM kill at "
        f"{limit // MIB} MiB: {basis}{capped}",
        {**evidence, "capped": memory < wanted},
        node=relaunch.node,
        memory_bytes=memory,
    )
