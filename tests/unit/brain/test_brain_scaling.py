"""Runtime scaling on synthetic scaling curves.

"Settles at 4 within three decisions" (issue #7), made precise: starting from 1
node on "linear up to 4, then flat", the brain must learn that a 5th node does
not pay, which takes measuring some size above 4 once. It doubles while the
curve is linear (1 -> 2 -> 4), probes 8, and returns to 4: from the decision
that first reaches 4, at most three decisions (here two more: 8, then 4), and
not one decision in the many polls after that.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unit.brain.brain_simulation import ROUND_MS, Simulation, knee, linear

from dlfleet.brain.optimizer.scaling import (
    ScalingSettings,
    ScalingState,
    abandonments,
    decide_scaling,
    step_origin,
)
from dlfleet.brain.records import Plan, PlanId, PlanKind, RoundMetrics

QUIET_POLLS = 30


def test_linear_to_4_then_flat_settles_at_4_within_three_decisions_of_reaching_it() -> None:
    sim = Simulation(knee(4), nodes=1, min_nodes=1, max_nodes=8)
    sizes = sim.run(8 + QUIET_POLLS)
    assert sizes == [2, 4, 8, 4]
    after_reaching_4 = sizes[sizes.index(4) + 1 :]
    assert len(after_reaching_4) <= 3 and after_reaching_4[-1] == 4
    assert sim.nodes == 4
    assert all(d.kind is PlanKind.NONE for d in sim.decisions[-QUIET_POLLS:])


def test_knee_at_4_started_at_4_probes_5_once_then_holds() -> None:
    sim = Simulation(knee(4), nodes=4, min_nodes=1, max_nodes=8)
    assert sim.run(5 + QUIET_POLLS) == [5, 4]


@pytest.mark.parametrize(
    ("knee_at", "max_nodes", "sizes"),
    [(5, 8, [2, 4, 8, 5]), (6, 8, [2, 4, 8, 6]), (12, 16, [2, 4, 8, 16, 12]), (3, 8, [2, 4, 3])],
)
def test_an_overshoot_lands_on_the_knee_estimated_inside_the_step(
    knee_at: int, max_nodes: int, sizes: list[int]
) -> None:
    # 4 -> 8 measured 5 nodes' worth (25/s per added node, not the 50 growing
    # asks for): the knee is estimated at 5; the job goes straight there, holds.
    sim = Simulation(knee(knee_at), nodes=1, min_nodes=1, max_nodes=max_nodes)
    assert sim.run(10 + QUIET_POLLS) == sizes
    assert sim.nodes == knee_at
    assert all(d.kind is PlanKind.NONE for d in sim.decisions[-QUIET_POLLS:])


def test_a_step_that_paid_on_average_is_kept() -> None:
    # 4 -> 8 measured 7 nodes' worth: 75/s per added node. A knee at 7 fits,
    # but so does a uniformly sub-linear curve: keep 8.
    sim = Simulation(knee(7), nodes=1, min_nodes=1, max_nodes=8)
    assert sim.run(8 + QUIET_POLLS) == [2, 4, 8]


def test_linear_all_the_way_grows_to_max() -> None:
    assert Simulation(linear(), nodes=1, min_nodes=1, max_nodes=10).run(20) == [2, 4, 8, 10]
    assert Simulation(linear(), nodes=1, min_nodes=1, max_nodes=16).run(20) == [2, 4, 8, 16]


def test_max_step_bounds_growth() -> None:
    sim = Simulation(
        linear(), nodes=1, min_nodes=1, max_nodes=16, settings=ScalingSettings(max_step=3)
    )
    assert sim.run(20) == [2, 4, 7, 10, 13, 16]


def test_no_decision_until_the_current_size_ran_a_full_round() -> None:
    short = RoundMetrics(
        round=1, nodes=2, world_size=2, started_ms=0, ended_ms=10_000, samples_per_s=200
    )
    decision = decide_scaling(ScalingState(1, 8, 2, [short]), ScalingSettings())
    assert decision.kind is PlanKind.NONE
    assert "measuring 2 nodes" in decision.reason


def test_no_decision_while_the_world_has_not_formed_at_the_target() -> None:
    r = RoundMetrics(
        round=3, nodes=3, world_size=3, started_ms=0, ended_ms=ROUND_MS, samples_per_s=300
    )
    decision = decide_scaling(ScalingState(1, 8, 4, [r]), ScalingSettings())
    assert decision.kind is PlanKind.NONE
    assert "waiting for a round with 4 nodes" in decision.reason


def test_size_outside_the_jobs_range_is_clamped() -> None:
    decision = decide_scaling(ScalingState(2, 6, 9, []), ScalingSettings())
    assert (decision.kind, decision.target_nodes) == (PlanKind.SCALE, 6)


def test_a_size_scaled_down_from_is_retried_only_on_strong_evidence() -> None:
    def rounds(rate_at_4: float) -> list[RoundMetrics]:
        return [
            RoundMetrics(1, 4, 4, 0, ROUND_MS, 400.0),
            RoundMetrics(2, 5, 5, ROUND_MS, 2 * ROUND_MS, 460.0),
            RoundMetrics(3, 4, 4, 2 * ROUND_MS, 3 * ROUND_MS, rate_at_4),
            RoundMetrics(4, 4, 4, 3 * ROUND_MS, 4 * ROUND_MS, rate_at_4),
        ]

    down = Plan(
        id=PlanId(1),
        job="j",
        kind=PlanKind.SCALE,
        reason="",
        evidence={"landing_samples_per_s": 400.0},
        created_ms=0,
        current_nodes=5,
        target_nodes=4,
        applied=True,
    )
    s = ScalingSettings()
    # 5 nodes add 60/s over 4 at 400/s (100/s per node at 4): worth growing
    # into, but not back into a size the job left for 4.
    fresh = ScalingState(1, 8, 4, rounds(400.0))
    assert decide_scaling(fresh, s).target_nodes > 4
    left = ScalingState(1, 8, 4, rounds(400.0), abandonments([down]), step_origin([down], 4))
    held = decide_scaling(left, s)
    assert held.kind is PlanKind.NONE
    assert "the job left 5 for 4 nodes" in held.reason
    # Noise at 4 (a 10% drift) changes nothing; 4 nodes running 30% slower does.
    assert (
        decide_scaling(ScalingState(1, 8, 4, rounds(370.0), abandonments([down])), s).kind
        is PlanKind.NONE
    )
    assert (
        decide_scaling(ScalingState(1, 8, 4, rounds(280.0), abandonments([down])), s).target_nodes
        > 4
    )


def test_every_scale_decision_explains_itself_with_its_numbers() -> None:
    sim = Simulation(knee(4), nodes=1, min_nodes=1, max_nodes=8)
    sim.run(6)
    for plan in sim.plans:
        assert f"to {plan.target_nodes} nodes" in plan.reason
        assert {"throughput", "reference_per_node", "marginal_per_node"} <= set(plan.evidence)
    assert sim.plans[-1].evidence["throughput"] == {
        "1": 100.0,
        "2": 200.0,
        "4": 400.0,
        "8": 400.0,
    }


def _direction_changes(path: list[int]) -> int:
    steps = [b - a for a, b in itertools.pairwise(path)]
    return sum(1 for a, b in itertools.pairwise(steps) if (a > 0) != (b > 0))


def assert_never_back_and_forth(sim: Simulation, start: int, best: int) -> None:
    """The node count goes up, then perhaps down, and never up again; no move
    is made twice; few moves after the first step down; and the job never
    ends below half of where it started or of what the curve offers."""
    path = [start, *sim.sizes]
    moves = list(itertools.pairwise(path))
    assert len(set(moves)) == len(moves), path
    assert _direction_changes(path) <= 1, path
    assert len(moves) <= 12, path
    downs = [i for i, (a, b) in enumerate(moves) if b < a]
    assert not downs or len(moves) - downs[0] <= 3, path
    assert sim.nodes >= 0.5 * min(best, start), path


# Checked on 6,000 random cases before settling on these bounds; derandomized so
# that CI runs the same examples every time.
@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    knee_at=st.integers(2, 12),
    max_nodes=st.integers(4, 32),
    start=st.integers(1, 4),
)
def test_noisy_measurements_never_flap(seed: int, knee_at: int, max_nodes: int, start: int) -> None:
    """±10% noise on every round (a single node's worth at 10 nodes)."""
    sim = Simulation(
        knee(knee_at), nodes=start, min_nodes=1, max_nodes=max_nodes, noise=0.1, seed=seed
    )
    sim.run(60)
    assert_never_back_and_forth(sim, start, min(knee_at, max_nodes))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), max_nodes=st.integers(2, 32))
def test_noisy_linear_curve_never_flaps(seed: int, max_nodes: int) -> None:
    sim = Simulation(linear(), nodes=1, min_nodes=1, max_nodes=max_nodes, noise=0.1, seed=seed)
    sim.run(60)
    assert_never_back_and_forth(sim, 1, max_nodes)


def test_rounds_too_short_to_measure_decide_nothing() -> None:
    instant = RoundMetrics(1, 2, 2, 0, 0, 200.0)
    s = ScalingSettings(min_round_s=0)
    assert decide_scaling(ScalingState(1, 8, 2, [instant]), s).kind is PlanKind.NONE
