"""A scripted master for the scaling optimizer: every poll it measures one
round at its current size on a synthetic scaling curve (optionally noisy),
asks the planner, and applies any scale plan at once."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dlfleet.brain.optimizer.scaling import (
    ScalingSettings,
    ScalingState,
    abandonments,
    decide_scaling,
    step_origin,
)
from dlfleet.brain.records import Decision, Plan, PlanId, PlanKind, RoundMetrics

ROUND_MS = 60_000


def knee(at: int, per_node: float = 100.0) -> Callable[[int], float]:
    """Linear up to `at` nodes, then flat."""
    return lambda n: per_node * min(n, at)


def linear(per_node: float = 100.0) -> Callable[[int], float]:
    return lambda n: per_node * n


@dataclass
class Simulation:
    curve: Callable[[int], float]
    nodes: int
    min_nodes: int
    max_nodes: int
    noise: float = 0.0
    seed: int = 0
    settings: ScalingSettings = field(default_factory=ScalingSettings)
    rounds: list[RoundMetrics] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def sizes(self) -> list[int]:
        """The size of every scale decision, in order."""
        return [p.target_nodes for p in self.plans]

    def poll(self) -> Decision:
        now = len(self.rounds) * ROUND_MS
        rate = self.curve(self.nodes) * (1 + self.rng.uniform(-self.noise, self.noise))
        self.rounds.append(
            RoundMetrics(
                round=len(self.rounds) + 1,
                nodes=self.nodes,
                world_size=self.nodes,
                started_ms=now,
                ended_ms=now + ROUND_MS,
                samples_per_s=rate,
            )
        )
        state = ScalingState(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            nodes=self.nodes,
            rounds=self.rounds,
            abandoned=abandonments(self.plans),
            came_from=step_origin(self.plans, self.nodes),
        )
        decision = decide_scaling(state, self.settings)
        self.decisions.append(decision)
        if decision.kind is PlanKind.SCALE:
            self.plans.append(
                Plan(
                    id=PlanId(len(self.plans) + 1),
                    job="sim",
                    kind=PlanKind.SCALE,
                    reason=decision.reason,
                    evidence=decision.evidence,
                    created_ms=now + ROUND_MS,
                    current_nodes=self.nodes,
                    target_nodes=decision.target_nodes,
                    applied=True,
                    applied_ms=now + ROUND_MS,
                )
            )
            self.nodes = decision.target_nodes
        return decision

    def run(self, polls: int) -> list[int]:
        for _ in range(polls):
            self.poll()
        return self.sizes
