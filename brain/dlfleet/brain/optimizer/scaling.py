"""Runtime scaling: how many nodes the job should run on, from the throughput
it measured at each node count so far.

The decision is a walk up the job's `Curve` from `min_nodes`: a size is
accepted when going from the last accepted size to it adds, per added node, at
least a share of `reference` (the throughput of one node at the smallest
measured size). The target is the last size accepted. Measured sizes use their
median; the rest, the curve's optimistic estimate. So:

- the job grows while the next node is predicted to pay (`grow_share`);
  growth into sizes never measured goes one node at a time, or doubles while
  the last measured step was near-linear (`linear_share`), so a linear curve
  reaches a large max in a few decisions (`max_step` bounds a jump);
- after a step up, the new size is measured, and the job steps back down when
  the step did not deliver (below `keep_share`, lower than `grow_share`: the
  gap is the hysteresis band that stops noise from toggling a decision). It
  lands on a measured size, or on the knee the curve estimates inside a step
  that did not pay as a whole (4 -> 8 nodes that only gave 5 nodes' worth: 5). A
  step down waits for `confirm_periods` measurement periods at the size
  (stepping up is cheap to undo, stepping down is remembered);
- once the job has held a size one period longer, the band widens: it leaves
  down only below `hold_share` and up only above `held_grow_share` (a median
  drifting with noise is not news);
- a size the job has been scaled down from ("abandoned"), and any size past
  it, is not tried again unless the evidence changed strongly: the throughput
  at the size the job went to must have moved by `retry_change` (a fraction)
  since. Noise does not bring it back; a job whose speed changed does;
- nothing is decided until the job has run at its current size for one round
  of `min_round_s` (the cooldown after every change and every disruption).
  The time at a size adds up the rounds since the job last ran another size.

With "linear up to 4 nodes, then flat", min 1 and max 8, starting at 1: 2 (first
step), 4 (linear: double), 8 (linear: double), then back to 4 (8 added nothing
over 4, and the knee estimate puts 5-7 at 4 nodes' worth too), and nothing
after: from the decision that reaches 4, two more (the probe and the return).
Starting at the knee (4), it probes 5 once and returns.

Pure: no I/O, no clock; the caller passes the rounds and what was decided.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.optimizer.curve import Curve
from dlfleet.brain.records import Decision, Plan, PlanKind, RoundMetrics


@dataclass(frozen=True)
class ScalingSettings:
    """Shares are of the reference throughput of one node."""

    grow_share: float = 0.5
    keep_share: float = 0.4
    hold_share: float = 0.2  # once held: leave down only below this...
    held_grow_share: float = 0.7  # ...and up only above this
    confirm_periods: int = 3  # a step down needs this many min_round_s at the size
    retry_change: float = 0.25
    linear_share: float = 0.9
    max_step: int = 0  # the most nodes added by one decision; 0 = no limit
    min_round_s: float = 60.0

    def __post_init__(self) -> None:
        shares = (self.hold_share, self.keep_share, self.grow_share, self.held_grow_share)
        if not 0 < shares[0] <= shares[1] <= shares[2] <= shares[3]:
            raise InvalidArgument(
                "scaling shares must satisfy "
                "0 < hold_share <= keep_share <= grow_share <= held_grow_share"
            )
        if self.retry_change <= 0 or self.confirm_periods < 1:
            raise InvalidArgument("retry_change must be > 0 and confirm_periods >= 1")
        if not 0 < self.linear_share <= 1:
            raise InvalidArgument("linear_share must lie in (0, 1]")
        if self.max_step < 0 or self.min_round_s < 0:
            raise InvalidArgument("max_step and min_round_s must be >= 0")


@dataclass(frozen=True)
class ScalingState:
    min_nodes: int
    max_nodes: int
    nodes: int  # the current target node count
    rounds: Sequence[RoundMetrics]
    abandoned: tuple[Abandonment, ...] = ()
    came_from: int | None = None  # where the last step up to `nodes` started


@dataclass(frozen=True)
class Abandonment:
    """An applied scale-down: from `left` to `landing`, which then ran (by the
    curve at the time) at `landing_rate` samples/s."""

    left: int
    landing: int
    landing_rate: float | None

    def as_evidence(self) -> dict[str, Any]:
        return {"left": self.left, "landing": self.landing, "landing_rate": self.landing_rate}


LANDING_RATE = "landing_samples_per_s"  # evidence key of a scale-down


def abandonments(plans: Iterable[Plan]) -> tuple[Abandonment, ...]:
    found = []
    for plan in plans:
        if plan.kind is PlanKind.SCALE and plan.applied and plan.target_nodes < plan.current_nodes:
            rate = plan.evidence.get(LANDING_RATE)
            found.append(
                Abandonment(
                    plan.current_nodes,
                    plan.target_nodes,
                    float(rate) if isinstance(rate, int | float) else None,
                )
            )
    return tuple(found)


def step_origin(plans: Sequence[Plan], nodes: int) -> int | None:
    """Where the latest applied step up to `nodes` started, if that is how
    the job got there."""
    for plan in reversed(plans):
        if plan.kind is PlanKind.SCALE and plan.applied:
            if plan.target_nodes == nodes and plan.current_nodes < nodes:
                return plan.current_nodes
            return None
    return None


def _none(reason: str, **evidence: Any) -> Decision:
    return Decision(PlanKind.NONE, reason, evidence)


def decide_scaling(state: ScalingState, settings: ScalingSettings) -> Decision:
    c, low, high = state.nodes, state.min_nodes, state.max_nodes
    if not low <= c <= high:
        target = min(max(c, low), high)
        return Decision(
            PlanKind.SCALE,
            f"scale from {c} to {target} nodes: the job allows {low}..{high}",
            {"nodes": c, "min_nodes": low, "max_nodes": high},
            target_nodes=target,
        )
    if not state.rounds:
        return _none(f"no round measured yet at {c} nodes", nodes=c)
    latest = max(state.rounds, key=lambda r: r.round)
    if latest.nodes != c:
        return _none(
            f"waiting for a round with {c} nodes (round {latest.round} has {latest.nodes})",
            nodes=c,
            round=latest.round,
            round_nodes=latest.nodes,
        )
    if latest.duration_s < settings.min_round_s:
        return _none(
            f"measuring {c} nodes: round {latest.round} has run {latest.duration_s:.0f} s "
            f"of the {settings.min_round_s:.0f} s a measurement takes",
            nodes=c,
            round=latest.round,
            round_s=latest.duration_s,
        )
    curve = Curve.from_rounds(state.rounds, settings.min_round_s)
    if not curve or curve.reference <= 0:
        return _none(f"no throughput measured yet at {c} nodes", nodes=c)
    return _Walk(state, settings, curve).decide()


def _time_at_size(rounds: Sequence[RoundMetrics], nodes: int) -> float:
    """How long the job has run at `nodes` since it last ran at another size."""
    held = 0.0
    for r in sorted(rounds, key=lambda r: r.round, reverse=True):
        if r.nodes != nodes:
            break
        held += r.duration_s
    return held


class _Walk:
    def __init__(self, state: ScalingState, settings: ScalingSettings, curve: Curve) -> None:
        self.state = state
        self.settings = settings
        self.curve = curve
        self.ref = curve.reference
        self.cap = self._growth_cap()
        self.upper = min(state.max_nodes, curve.largest + self.cap)
        self.held_s = _time_at_size(state.rounds, state.nodes)
        # Held: the job ran at its size past the first decision to step down.
        self.held = self.held_s >= (settings.confirm_periods + 1) * settings.min_round_s

    def _growth_cap(self) -> int:
        """How far beyond the largest measured size one decision may go."""
        curve, s = self.curve, self.settings
        cap = 1
        if len(curve.sizes) >= 2 and curve.slope_into(curve.largest) >= s.linear_share * self.ref:
            cap = curve.largest
        return min(cap, s.max_step) if s.max_step else cap

    def threshold(self, size: int) -> float:
        s, c = self.settings, self.state.nodes
        if size == c:
            return (s.hold_share if self.held else s.keep_share) * self.ref
        if size > c and any(self._blocks(a, size) for a in self.state.abandoned):
            return math.inf
        if size > c and self.held:
            return s.held_grow_share * self.ref
        return s.grow_share * self.ref

    def _blocks(self, abandonment: Abandonment, size: int) -> bool:
        """Whether `abandonment` keeps the job from `size`: it lies past the
        landing, and the throughput there has not moved by `retry_change`."""
        if size <= abandonment.landing:
            return False
        now, then = self.curve.measured(abandonment.landing), abandonment.landing_rate
        if now is None or then is None or then <= 0:
            return True
        return abs(now - then) < self.settings.retry_change * then

    def marginal(self, frm: int, to: int) -> float:
        return (self.curve.estimate(to) - self.curve.estimate(frm)) / (to - frm)

    def target(self, start: int | None = None) -> tuple[int, int | None]:
        """(the last size accepted walking up from `start` (min_nodes), the
        first size above it refused)."""
        accepted = self.state.min_nodes if start is None else start
        refused: int | None = None
        for size in range(accepted + 1, self.upper + 1):
            if self.marginal(accepted, size) >= self.threshold(size):
                accepted = size
                refused = None
            elif refused is None:
                refused = size
        return accepted, refused

    def evidence(self, target: int, **extra: Any) -> dict[str, Any]:
        c = self.state.nodes
        return {
            "nodes": c,
            "target": target,
            "throughput": self.curve.table(),
            "rounds": {str(n): p.rounds for n in self.curve.sizes if (p := self.curve.point(n))},
            "reference_per_node": round(self.ref, 3),
            "estimate": {
                str(n): round(self.curve.estimate(n), 3)
                for n in range(max(self.state.min_nodes, min(c, target) - 1), self.upper + 1)
            },
            "abandoned": [a.as_evidence() for a in self.state.abandoned],
            "growth_cap": self.cap,
            **extra,
        }

    def settle_down(self, target: int) -> int:
        """Where a step down lands. The walk's optimism suits exploring up, not
        retreating into the unknown: an unmeasured size is a landing only when
        it lies within the step just measured and that step, on average, did
        not deliver more than `grow_share` per node (a step that did fits a
        uniformly sub-linear curve as well as a knee inside it), and the nodes
        dropped are estimated to add next to nothing (below half `keep_share`).
        Otherwise the landing is a measured size that `nodes` does not pay off
        against (below `keep_share`), or the job holds."""
        c, origin = self.state.nodes, self.state.came_from
        keep = self.threshold(c)
        step_failed = (
            origin is not None
            and self.curve.measured(origin) is not None
            and self.marginal(origin, c) <= self.settings.grow_share * self.ref
        )
        landings = [target, *(n for n in self.curve.sizes if target < n < c)]
        for size in landings:
            if self.curve.measured(size) is not None:
                if self.marginal(size, c) < keep:
                    return size
            elif (
                step_failed
                and origin is not None
                and origin < size < c
                and self.marginal(size, c) < keep / 2
            ):
                return size
        return c

    def decide(self) -> Decision:
        c = self.state.nodes
        walked, refused = self.target()
        target = self.settle_down(walked) if walked < c else walked
        if walked < c and target == c:
            # Staying: the sizes below are settled, so judge growth from here.
            target, refused = self.target(start=c)
        if self.settings.max_step:
            target = min(target, c + self.settings.max_step)
        if target > c:
            return self._up(target)
        if target < c:
            confirm_s = self.settings.confirm_periods * self.settings.min_round_s
            if self.held_s < confirm_s:
                return _none(
                    f"confirming {c} nodes before stepping down to {target}: "
                    f"{self.held_s:.0f} s of the {confirm_s:.0f} s measured",
                    **self.evidence(target, held_s=self.held_s),
                )
            return self._down(target)
        ref = self.ref
        if refused is None:  # every size up to `upper` paid: c is the max
            return _none(f"hold at {c} nodes: the most the job allows", **self.evidence(c))
        blocking = [a for a in self.state.abandoned if self._blocks(a, refused)]
        if blocking:
            a = blocking[-1]
            now = self.curve.measured(a.landing)
            return _none(
                f"hold at {c} nodes: the job left {a.left} for {a.landing} nodes "
                f"(then {a.landing_rate or 0:.1f} samples/s, now {now or 0:.1f}); sizes above "
                f"{a.landing} are tried again only after a "
                f"{self.settings.retry_change:.0%} change there",
                **self.evidence(c),
            )
        gain = self.marginal(c, refused)
        how = "measured" if self.curve.measured(refused) is not None else "predicted"
        return _none(
            f"hold at {c} nodes: {refused} nodes {how} at "
            f"{self.curve.estimate(refused):.1f} samples/s, {gain:+.2f} per added node "
            f"< {self.threshold(refused) / ref:.2f} x {ref:.2f} (one node's throughput)",
            **self.evidence(c, marginal_per_node=round(gain, 3)),
        )

    def _up(self, target: int) -> Decision:
        c, ref = self.state.nodes, self.ref
        gain = self.marginal(c, target)
        how = "measured" if self.curve.measured(target) is not None else "predicted"
        return Decision(
            PlanKind.SCALE,
            f"scale up from {c} to {target} nodes: {target} nodes {how} at "
            f"{self.curve.estimate(target):.1f} samples/s against "
            f"{self.curve.estimate(c):.1f} at {c}, {gain:+.2f} per added node "
            f">= {self.threshold(target) / ref:.2f} x {ref:.2f} (one node's throughput)",
            self.evidence(target, marginal_per_node=round(gain, 3)),
            target_nodes=target,
        )

    def _down(self, target: int) -> Decision:
        c, ref = self.state.nodes, self.ref
        gain = self.marginal(target, c)
        how = "measured" if self.curve.measured(target) is not None else "estimated"
        return Decision(
            PlanKind.SCALE,
            f"scale down from {c} to {target} nodes: {c} nodes measured "
            f"{self.curve.estimate(c):.1f} samples/s against {self.curve.estimate(target):.1f} "
            f"{how} at {target}, {gain:+.2f} per added node "
            f"< {self.threshold(c) / ref:.2f} x {ref:.2f} (one node's throughput)",
            self.evidence(
                target,
                marginal_per_node=round(gain, 3),
                held_s=self.held_s,
                **{LANDING_RATE: round(self.curve.estimate(target), 3)},
            ),
            target_nodes=target,
        )
