"""Property-based tests of the node check's board on a simulated fleet
(`node_check_fleet`): whatever the cohort's size, the hosts the nodes share,
the noise in healthy nodes' numbers and which node is bad,

- one slow (matmul or link) or broken node among three or more is found, by
  the rule of its fault, and no healthy node is faulted with it;
- a fleet of healthy nodes is all healthy;
- every node that began gets exactly one verdict, in bounded time, even when
  nodes never get ready, go silent in a pair or crash; a healthy node is
  faulted only when both its partners are broken;
- a host never measures two things at once and a node is never in two pairs
  (checked after every step by the fleet).

A hypothesis state machine also drives the board with reports in any order,
duplicates, polls, stale orders and losses, and checks that verdicts are
final and sequence numbers only grow.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from unit.core.node_check_fleet import Fleet, SimNode

from dlfleet.master.core.node_check import (
    CheckFailed,
    ComputeDone,
    ComputeOrder,
    Effect,
    NodeCheckBoard,
    NodeCheckSettings,
    PairDone,
    PairOrder,
    Ready,
    Result,
)
from dlfleet.master.core.node_check_verdict import CheckRule, Verdict

SETTINGS = NodeCheckSettings(slow_factor=2.0, step_timeout_ms=5_000)

KIND_RULE = {
    "slow_compute": CheckRule.COMPUTE_SLOW,
    "slow_link": CheckRule.PAIRS_SLOW,
    "broken": CheckRule.PAIRS_FAILED,
}


@st.composite
def fleets(draw: st.DrawFn, bad: bool) -> tuple[list[SimNode], str | None, str]:
    n = draw(st.integers(3, 9))
    hosts = draw(st.integers(1, n))
    nodes = [
        SimNode(
            f"n{i}#1",
            f"h{draw(st.integers(0, hosts - 1))}",
            compute_ms=draw(st.floats(10.0, 13.0)),
            link_ms=draw(st.floats(5.0, 6.5)),
        )
        for i in range(n)
    ]
    if not bad:
        return nodes, None, ""
    culprit = nodes[draw(st.integers(0, n - 1))]
    kind = draw(st.sampled_from(sorted(KIND_RULE)))
    slowdown = draw(st.floats(3.5, 20.0))
    if kind == "slow_compute":
        culprit.compute_ms *= slowdown
    elif kind == "slow_link":
        culprit.link_ms *= slowdown
    else:
        culprit.behaviour = "broken"
    return nodes, culprit.name, kind


def run(nodes: list[SimNode], seed: int, expected: int) -> dict[str, Verdict]:
    fleet = Fleet(NodeCheckSettings(slow_factor=2.0, expected_nodes=expected), seed=seed)
    for node in nodes:
        fleet.begin(node)
    verdicts = fleet.run()
    assert set(verdicts) == {node.name for node in nodes}
    return verdicts


@settings(max_examples=150, deadline=None)
@given(fleets(bad=True), st.integers(0, 1000), st.booleans())
def test_one_bad_node_is_found_by_its_rule_and_nobody_else(
    fleet: tuple[list[SimNode], str | None, str], seed: int, all_expected: bool
) -> None:
    nodes, culprit, kind = fleet
    verdicts = run(nodes, seed, len(nodes) if all_expected else 1_000)
    found = {name: v.rule for name, v in verdicts.items() if v.faulty}
    assert found == {culprit: KIND_RULE[kind]}, {n: v.reason for n, v in verdicts.items()}


@settings(max_examples=100, deadline=None)
@given(fleets(bad=False), st.integers(0, 1000))
def test_healthy_nodes_are_all_healthy(
    fleet: tuple[list[SimNode], str | None, str], seed: int
) -> None:
    verdicts = run(fleet[0], seed, len(fleet[0]))
    assert not [v.reason for v in verdicts.values() if v.faulty]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["ok", "ok", "ok", "mute", "silent", "broken", "crash"]), min_size=1,
             max_size=8),
    st.integers(0, 1000),
)  # fmt: skip
def test_every_node_gets_one_verdict_in_bounded_time(behaviours: list[str], seed: int) -> None:
    nodes = [SimNode(f"n{i}#1", f"h{i % 3}", behaviour=b) for i, b in enumerate(behaviours)]
    verdicts = run(nodes, seed, len(nodes))
    for node in nodes:
        verdict = verdicts[node.name]
        if node.behaviour == "mute":
            assert verdict.rule is CheckRule.HUNG
        if node.behaviour == "silent":  # hung in its first pair, if it had one
            assert verdict.rule is CheckRule.HUNG or not verdict.pairs
        if node.behaviour == "crash":
            assert verdict.rule is CheckRule.CHECK_FAILED
        if node.behaviour == "ok" and verdict.faulty:
            # A healthy node is faulted only when both its partners were broken.
            assert verdict.rule is CheckRule.PAIRS_FAILED, verdict.reason
            peers = {p.peer for p in verdict.pairs}
            assert all(nodes[int(p[1:].split("#")[0])].behaviour == "broken" for p in peers)


class BoardMachine(RuleBasedStateMachine):
    """Reports in any order and repetition; verdicts stay final."""

    NAMES = ("a#1", "b#1", "c#1", "d#1")

    def __init__(self) -> None:
        super().__init__()
        self.board = NodeCheckBoard(SETTINGS, "m")
        self.now = 0
        self.seqs: dict[str, int] = {}
        self.final: dict[str, Verdict] = {}

    def record(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Verdict):
                assert effect.node_id not in self.final or self.final[effect.node_id] != effect
                self.final[effect.node_id] = effect

    @rule(name=st.sampled_from(NAMES), host=st.sampled_from(["h1", "h2"]))
    def begin(self, name: str, host: str) -> None:
        self.final.pop(name, None)
        self.seqs.pop(name, None)
        self.record(self.board.begin(name, host, self.now))

    @rule(name=st.sampled_from(NAMES), answer=st.sampled_from(["current", "stale", "poll"]),
          ok=st.booleans(), ms=st.floats(0.1, 100.0))  # fmt: skip
    def report(self, name: str, answer: str, ok: bool, ms: float) -> None:
        if name not in self.board.nodes:
            return
        seq, order = self.board.order(name)
        done = seq if answer == "current" else max(0, seq - 1)
        result: Result = None
        if answer != "poll":
            if isinstance(order, ComputeOrder):
                result = ComputeDone(ms)
            elif isinstance(order, PairOrder):
                result = PairDone(order.pair, ok, ms, "" if ok else "reset")
            elif order is None:
                result = Ready()
        self.record(self.board.report(name, done, result, self.now, store_port=1000 + seq))

    @rule(name=st.sampled_from(NAMES))
    def fail(self, name: str) -> None:
        if name in self.board.nodes:
            seq, _ = self.board.order(name)
            self.record(self.board.report(name, seq, CheckFailed("boom"), self.now))

    @rule(name=st.sampled_from(NAMES))
    def lose(self, name: str) -> None:
        self.final.pop(name, None)
        self.seqs.pop(name, None)
        self.record(self.board.node_lost(name, self.now))

    @rule(ms=st.integers(1, 8_000))
    def advance(self, ms: int) -> None:
        self.now += ms
        self.record(self.board.tick(self.now))

    @precondition(lambda self: bool(self.board.nodes))
    @invariant()
    def verdicts_are_final_and_orders_only_grow(self) -> None:
        for name in list(self.board.nodes):
            seq, order = self.board.order(name)
            assert seq >= self.seqs.get(name, 0)
            self.seqs[name] = seq
            if name in self.final:
                assert order == self.final[name]
                assert not self.board.checking(name)


TestBoardMachine = BoardMachine.TestCase
TestBoardMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
