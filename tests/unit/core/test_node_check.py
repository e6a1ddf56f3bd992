"""The node check's board (`dlfleet.master.core.node_check`), scripted on a
simulated fleet in simulated time: who measures what, when, and the verdicts
with their numbers."""

from __future__ import annotations

import pytest
from unit.core.node_check_fleet import Fleet, SimNode

from dlfleet.api.errors import InvalidArgument, NotFound
from dlfleet.master.core.node_check import (
    ComputeDone,
    ComputeOrder,
    NodeCheckBoard,
    NodeCheckSettings,
    PairOrder,
    Ready,
    cycle_pairs,
)
from dlfleet.master.core.node_check_verdict import CheckRule, PairOutcome, Verdict

SETTINGS = NodeCheckSettings(slow_factor=2.0, step_timeout_ms=10_000, expected_nodes=4)


def fleet_of(*nodes: SimNode, settings: NodeCheckSettings = SETTINGS) -> Fleet:
    fleet = Fleet(settings)
    for node in nodes:
        fleet.begin(node)
    return fleet


def faulty(verdicts: dict[str, Verdict]) -> dict[str, CheckRule]:
    return {name: v.rule for name, v in verdicts.items() if v.faulty}


@pytest.mark.parametrize("n", range(3, 10))
def test_the_cycle_gives_every_node_two_partners_in_rounds_of_disjoint_pairs(n: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    edges = cycle_pairs(nodes)
    assert len(edges) == n
    partners = {node: {b if a == node else a for a, b in edges if node in (a, b)} for node in nodes}
    assert all(len(p) == 2 for p in partners.values())
    half = n // 2  # rounds A and B, then (odd n) C: the edge that closes the cycle
    for chunk in (edges[:half], edges[half : 2 * half], edges[2 * half :]):
        touched = [node for edge in chunk for node in edge]
        assert len(touched) == len(set(touched))


def test_two_nodes_have_one_pair_and_one_has_none() -> None:
    assert cycle_pairs(["a", "b"]) == [("a", "b")]
    assert cycle_pairs(["a"]) == []


def test_healthy_nodes_are_healthy_with_their_numbers() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", f"h{i}", 10 + i, 5 + i / 10) for i in range(4)))
    verdicts = fleet.run()
    assert faulty(verdicts) == {}
    v = verdicts["n0#1"]
    assert v.compute_ms == 10 and v.compute_reference_ms == 12  # the median of 11, 12, 13
    assert len(v.pairs) == 2 and all(p.outcome is PairOutcome.GOOD for p in v.pairs)
    assert "matmul 10.0 ms" in v.reason and "all-reduce with" in v.reason


def test_a_slow_matmul_is_faulty_and_says_by_how_much() -> None:
    fleet = fleet_of(SimNode("a#1", "h1", 10), SimNode("b#1", "h2", 11), SimNode("c#1", "h3", 33))
    verdicts = fleet.run()
    assert faulty(verdicts) == {"c#1": CheckRule.COMPUTE_SLOW}
    assert "matmul 33.0 ms, 3.1x the median 10.5 ms" in verdicts["c#1"].reason
    assert "slow_factor 2" in verdicts["c#1"].reason


def test_a_slow_matmul_is_measured_again_and_a_moment_of_noise_faults_nobody() -> None:
    fleet = fleet_of(
        SimNode("a#1", "h1", 10), SimNode("b#1", "h2", 11, noise_ms=40), SimNode("c#1", "h3", 33)
    )
    verdicts = fleet.run()
    assert faulty(verdicts) == {"c#1": CheckRule.COMPUTE_SLOW}
    assert verdicts["b#1"].compute_ms == 11  # the faster of its two matmuls
    assert [fleet.nodes[n].computes for n in ("a#1", "b#1", "c#1")] == [1, 2, 2]


def test_a_node_slow_on_the_wire_is_isolated_not_its_partners() -> None:
    names = ["a", "b", "c", "d"]
    fleet = fleet_of(*(SimNode(f"{x}#1", x, 10, 20 if x == "c" else 5) for x in names))
    verdicts = fleet.run()
    assert faulty(verdicts) == {"c#1": CheckRule.PAIRS_SLOW}
    assert {p.outcome for p in verdicts["c#1"].pairs} == {PairOutcome.SLOW}
    for partner in ("b#1", "d#1"):  # each kept one good pair
        outcomes = sorted(p.outcome.value for p in verdicts[partner].pairs)
        assert outcomes == ["good", "slow"]


@pytest.mark.parametrize("n", [3, 5])
def test_a_broken_node_is_faulty_its_partners_healthy(n: int) -> None:
    nodes = [SimNode(f"n{i}#1", f"h{i}", 10, 5, "broken" if i == 1 else "ok") for i in range(n)]
    verdicts = fleet_of(*nodes).run()
    assert faulty(verdicts) == {"n1#1": CheckRule.PAIRS_FAILED}
    assert "Connection reset by peer" in verdicts["n1#1"].reason


def test_two_nodes_are_judged_by_their_matmuls_a_failed_pair_blames_neither() -> None:
    verdicts = fleet_of(SimNode("a#1", "h1"), SimNode("b#1", "h2", 10, 5, "broken")).run()
    assert faulty(verdicts) == {}
    assert verdicts["a#1"].pairs[0].outcome is PairOutcome.UNATTRIBUTED
    assert "blames neither node" in verdicts["a#1"].reason
    verdicts = fleet_of(SimNode("a#1", "h1", 10), SimNode("b#1", "h2", 25)).run()
    assert faulty(verdicts) == {"b#1": CheckRule.COMPUTE_SLOW}


def test_a_node_that_never_gets_ready_is_hung_and_the_others_go_on_without_it() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", f"h{i}", behaviour="mute" if i == 2 else "ok")
                       for i in range(4)))  # fmt: skip
    verdicts = fleet.run()
    assert faulty(verdicts) == {"n2#1": CheckRule.HUNG}
    assert verdicts["n2#1"].reason == "did not start its check within 40s"  # 4x the step timeout
    assert all(len(verdicts[n].pairs) == 2 for n in ("n0#1", "n1#1", "n3#1"))


def test_a_node_silent_in_a_pair_is_hung_its_partner_not() -> None:
    nodes = [SimNode(f"n{i}#1", f"h{i}", behaviour="silent" if i == 0 else "ok") for i in range(4)]
    verdicts = fleet_of(*nodes).run()
    assert faulty(verdicts) == {"n0#1": CheckRule.HUNG}
    assert "no result for its all-reduce with n1#1 within 10s" in verdicts["n0#1"].reason


def test_a_crashed_check_is_faulty_at_once_with_its_error() -> None:
    nodes = [SimNode(f"n{i}#1", f"h{i}", behaviour="crash" if i == 3 else "ok") for i in range(4)]
    verdicts = fleet_of(*nodes).run()
    assert faulty(verdicts) == {"n3#1": CheckRule.CHECK_FAILED}
    assert verdicts["n3#1"].reason == "CUDA error: device-side assert"


def test_nodes_on_one_host_take_turns() -> None:
    """Every step checks the host is measuring one thing (Fleet.check_invariants)."""
    fleet = fleet_of(*(SimNode(f"n{i}#1", "127.0.0.1", 10) for i in range(4)))
    first = fleet.board.order("n0#1")
    fleet.step()  # everyone says ready; the cohort forms (4 expected)
    orders = [fleet.board.order(f"n{i}#1")[1] for i in range(4)]
    assert sum(isinstance(o, ComputeOrder) for o in orders) == 1, (first, orders)
    assert faulty(fleet.run()) == {}


def test_a_cohort_forms_once_the_expected_nodes_are_in_or_after_the_gather_time() -> None:
    board = NodeCheckBoard(SETTINGS, "c")
    board.begin("a#1", "h1", 0)
    board.report("a#1", 0, Ready(), 10, store_port=1)
    assert board.order("a#1") == (0, None)  # 1 of 4 expected: wait
    board.tick(SETTINGS.gather_ms - 1)
    assert board.order("a#1") == (0, None)
    board.tick(SETTINGS.gather_ms)
    assert board.order("a#1") == (1, ComputeOrder(SETTINGS.matmul_size, SETTINGS.matmul_repeats))


def test_nothing_to_compare_with_is_healthy() -> None:
    verdicts = fleet_of(SimNode("only#1", "h1", 500)).run()
    assert not verdicts["only#1"].faulty
    assert verdicts["only#1"].reason == "matmul 500.0 ms"


def test_a_late_node_is_compared_with_the_healthy_ones_and_pairs_with_a_helper() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", f"h{i}", 10) for i in range(4)))
    fleet.run()
    fleet.helpers = {f"n{i}#1": fleet.nodes[f"n{i}#1"] for i in range(4)}  # now training
    fleet.begin(SimNode("n4#1", "h4", 11, link_ms=40))  # slow link, but helpers are busy
    verdicts = fleet.run()
    late = verdicts["n4#1"]
    assert not late.faulty, late.reason
    assert late.compute_reference_ms == 10
    assert [(p.helper, p.outcome) for p in late.pairs] == [(True, PairOutcome.GOOD)]
    assert "(healthy helper)" in late.reason
    fleet.begin(SimNode("n5#1", "h5", 35))
    assert faulty(fleet.run()) == {"n5#1": CheckRule.COMPUTE_SLOW}


def test_a_late_node_is_not_compared_with_nodes_training_on_its_own_host() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", "shared", 10) for i in range(3)))
    fleet.run()
    fleet.helpers = {f"n{i}#1": fleet.nodes[f"n{i}#1"] for i in range(3)}
    fleet.begin(SimNode("n3#1", "shared", 35))  # its host is busy with their training
    late = fleet.run()["n3#1"]
    assert not late.faulty and late.compute_reference_ms == 0, late.reason


def test_a_failed_helper_pair_faults_the_late_node() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", f"h{i}", 10) for i in range(3)))
    fleet.run()
    fleet.helpers = {"n0#1": fleet.nodes["n0#1"]}
    fleet.begin(SimNode("n3#1", "h3", 10, behaviour="broken"))
    verdicts = fleet.run()
    assert faulty(verdicts) == {"n3#1": CheckRule.PAIRS_FAILED}
    assert "with n0#1 (healthy helper) failed (Connection reset by peer)" in verdicts["n3#1"].reason
    [push] = fleet.all_pushed
    assert push.helper == "n0#1" and push.order.rank == 1 and push.order.peer == "n3#1"
    assert push.order.timeout_ms == SETTINGS.helper_timeout_ms


def test_a_lost_node_gets_no_verdict_and_its_pairs_blame_it() -> None:
    fleet = fleet_of(*(SimNode(f"n{i}#1", f"h{i}", 10) for i in range(4)))
    while not any(isinstance(fleet.board.order(f"n{i}#1")[1], PairOrder) for i in range(4)):
        fleet.step()
    fleet.take(fleet.board.node_lost("n1#1", fleet.now))
    del fleet.nodes["n1#1"]
    verdicts = fleet.run()
    assert faulty(verdicts) == {}
    assert "n1#1" not in verdicts


def test_a_retried_or_stale_report_changes_nothing() -> None:
    board = NodeCheckBoard(NodeCheckSettings(expected_nodes=1), "c")
    board.begin("a#1", "h", 0)
    board.report("a#1", 0, Ready(), 1, store_port=5)
    seq, order = board.order("a#1")
    assert isinstance(order, ComputeOrder)
    board.report("a#1", seq, ComputeDone(7.0), 2)
    assert board.order("a#1")[1] == board.verdicts["a#1"]
    board.report("a#1", seq, ComputeDone(700.0), 3)  # the same report again
    board.report("a#1", 0, Ready(), 4)
    assert board.verdicts["a#1"].compute_ms == 7.0
    assert board.order("a#1")[0] == seq + 1


def test_a_board_that_does_not_know_a_node_starts_it_over() -> None:
    """A master restarted mid-check: the node's next report makes it ready here."""
    board = NodeCheckBoard(NodeCheckSettings(expected_nodes=1), "new")
    board.report("a#1", 7, ComputeDone(9.0), 100, host="h", store_port=5)
    seq, order = board.order("a#1")
    assert seq == 1 and isinstance(order, ComputeOrder)  # measured again, on this board


def test_unknown_nodes_and_bad_settings_are_refused() -> None:
    board = NodeCheckBoard(SETTINGS, "c")
    with pytest.raises(NotFound):
        board.order("nobody#1")
    with pytest.raises(InvalidArgument):
        NodeCheckSettings(slow_factor=1.0)
    with pytest.raises(InvalidArgument):
        board.begin("", "h", 0)
