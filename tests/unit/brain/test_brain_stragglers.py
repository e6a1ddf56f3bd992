from __future__ import annotations

from dlfleet.brain.optimizer.stragglers import StragglerSettings, find_straggler
from dlfleet.brain.records import NodeSample, PlanKind

NOW = 1_000_000
S = StragglerSettings(slowdown=1.5, windows=3, window_s=30)


def samples(steps: dict[str, list[float]]) -> list[NodeSample]:
    """One sample per node per window, newest window first."""
    out = []
    for node, per_window in steps.items():
        for j, step in enumerate(per_window):
            out.append(NodeSample(node, 1, NOW - j * 30_000 - 10_000, step_time_s=step))
    return out


def test_a_node_slow_in_every_window_is_replaced() -> None:
    plan = find_straggler(
        samples({"a": [1.0, 1.0, 1.0], "b": [1.1, 0.9, 1.0], "c": [2.0, 1.8, 1.9]}), NOW, S
    )
    assert plan is not None
    assert (plan.kind, plan.node) == (PlanKind.REPLACE_NODE, "c")
    assert plan.evidence["ratios_newest_first"] == [1.905, 1.895, 1.9]
    assert "replace node c" in plan.reason


def test_one_fast_window_clears_the_node() -> None:
    steps = {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 1.0], "c": [2.0, 1.2, 2.0]}
    assert find_straggler(samples(steps), NOW, S) is None


def test_a_window_without_samples_clears_the_node() -> None:
    steps = {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [3.0, 3.0]}  # two windows only
    assert find_straggler(samples(steps), NOW, S) is None


def test_two_nodes_compare_with_each_other() -> None:
    plan = find_straggler(samples({"a": [1.0] * 3, "b": [1.6] * 3}), NOW, S)
    assert plan is not None and plan.node == "b"


def test_a_node_just_replaced_is_left_alone() -> None:
    steps = {"a": [1.0] * 3, "b": [1.0] * 3, "c": [3.0] * 3}
    assert find_straggler(samples(steps), NOW, S, recently_replaced={"c"}) is None
