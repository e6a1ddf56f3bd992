from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.optimizer.stragglers import StragglerSettings, find_straggler
from dlfleet.brain.records import NodeCheckRecord, NodeSample, PlanKind

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


def check(
    node: str, compute: float = 10.0, pair: float = 1.0, faulty: bool = False
) -> NodeCheckRecord:
    """A pre-flight check that measured `node` at `compute` ms of matmul and
    `pair` ms of all-reduce, against medians of 10 and 1 ms."""
    rule = "compute_slow" if faulty else "healthy"
    return NodeCheckRecord(node, NOW - 600_000, faulty, rule, compute, 10.0, pair, 1.0)


def test_a_node_the_check_measured_slow_is_replaced_on_one_window() -> None:
    steps = {"a": [1.0], "b": [1.0], "c": [2.0]}  # one window of training so far
    assert find_straggler(samples(steps), NOW, S) is None
    checks = {"a": check("a"), "b": check("b"), "c": check("c", compute=14.0)}
    plan = find_straggler(samples(steps), NOW, S, checks=checks)
    assert plan is not None and plan.node == "c"
    assert plan.evidence["windows"] == 1
    assert plan.evidence["node_check"]["slowdown"] == 1.4
    assert "pre-flight check had already measured it at 1.40 x" in plan.reason


def test_a_slow_all_reduce_at_the_check_makes_a_suspect_too() -> None:
    steps = {"a": [1.0], "b": [1.0], "c": [1.8]}
    checks = {"c": check("c", pair=1.3)}
    plan = find_straggler(samples(steps), NOW, S, checks=checks)
    assert plan is not None and plan.node == "c"


def test_a_check_near_the_median_changes_nothing() -> None:
    steps = {"a": [1.0], "b": [1.0], "c": [2.0]}
    checks = {"c": check("c", compute=11.0, pair=1.1)}
    assert find_straggler(samples(steps), NOW, S, checks=checks) is None


def test_a_suspect_must_still_be_slow_in_training() -> None:
    steps = {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 1.0], "c": [1.2, 3.0, 3.0]}
    checks = {"c": check("c", compute=20.0)}
    assert find_straggler(samples(steps), NOW, S, checks=checks) is None  # fast now


def test_a_suspect_goes_first_when_two_nodes_are_slow() -> None:
    steps = {"a": [1.0] * 3, "b": [1.0] * 3, "c": [3.0] * 3, "d": [2.0] * 3}
    plan = find_straggler(samples(steps), NOW, S, checks={"d": check("d", compute=13.0)})
    assert plan is not None and plan.node == "d"
    assert plan.evidence["others_slow"] == ["c"]


def test_suspect_settings_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="suspect"):
        StragglerSettings(suspect_slowdown=1.0)
    with pytest.raises(InvalidArgument, match="suspect"):
        StragglerSettings(windows=2, suspect_windows=3)


@given(
    steps=st.dictionaries(
        st.sampled_from("abcde"),
        st.lists(st.floats(0.1, 5.0), min_size=1, max_size=3),
        min_size=2,
    ),
    compute=st.dictionaries(st.sampled_from("abcde"), st.floats(1.0, 40.0)),
)
def test_remembering_checks_only_ever_adds_evidence(
    steps: dict[str, list[float]], compute: dict[str, float]
) -> None:
    """Whatever the checks said, a straggler found without them is still
    found with them (perhaps another first), and a plan made only thanks to
    a check names a node the check measured slow."""
    checks = {n: check(n, compute=ms) for n, ms in compute.items()}
    without = find_straggler(samples(steps), NOW, S)
    with_checks = find_straggler(samples(steps), NOW, S, checks=checks)
    if without is not None:
        assert with_checks is not None
    if with_checks is not None and without is None:
        assert checks[with_checks.node].slowdown >= S.suspect_slowdown
