from __future__ import annotations

import pytest

from dlfleet.brain.optimizer.curve import Curve, SizePoint
from dlfleet.brain.records import RoundMetrics


def curve(points: dict[int, float]) -> Curve:
    return Curve({n: SizePoint(n, rate, 1, n) for n, rate in points.items()})


def test_measured_sizes_take_the_median_of_rounds_long_enough_to_count() -> None:
    rounds = [
        RoundMetrics(1, 2, 8, 0, 60_000, 100.0),
        RoundMetrics(2, 2, 8, 0, 60_000, 300.0),
        RoundMetrics(3, 2, 8, 0, 60_000, 110.0),
        RoundMetrics(4, 2, 8, 0, 5_000, 1.0),  # too short: a restart, not a measurement
        RoundMetrics(5, 4, 16, 0, 60_000, 200.0),
    ]
    c = Curve.from_rounds(rounds, min_duration_s=30)
    assert c.sizes == [2, 4]
    assert c.measured(2) == 110.0
    point = c.point(2)
    assert point is not None and (point.rounds, point.world_size) == (3, 8)


def test_estimates_assume_a_knee_inside_a_gap() -> None:
    c = curve({2: 200.0, 4: 400.0, 8: 600.0})
    assert [c.estimate(n) for n in (5, 6, 7)] == [500.0, 600.0, 600.0]
    assert c.estimate(1) == 100.0  # linear through the origin below the smallest size
    assert c.estimate(10) == pytest.approx(700.0)  # the last slope (50/node) continued


def test_a_drop_is_no_gain_and_a_super_linear_segment_no_promise() -> None:
    dropping = curve({1: 100.0, 2: 200.0, 4: 150.0})
    assert dropping.estimate(6) == 150.0
    assert dropping.estimate(3) == 200.0
    steep = curve({1: 100.0, 2: 260.0})
    assert steep.slope_into(2) == 100.0
    assert steep.estimate(3) == 360.0


def test_efficiency_is_against_linear_scaling_from_the_smallest_size() -> None:
    c = curve({2: 200.0, 4: 360.0, 8: 400.0})
    assert c.reference == 100.0
    assert c.efficiency(4) == pytest.approx(0.9)
    assert c.efficiency(8) == pytest.approx(0.5)
