"""The rendezvous core with a fake clock: completion rules, node_unit,
exclusivity, dead members, stale rounds, rank stability; and a state machine
that checks its invariants under random joins, deaths and time."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dlfleet.api.errors import TRAINING_DONE_REFUSAL, InvalidArgument, StaleError, TrainingDone
from dlfleet.master.core.rendezvous import (
    Member,
    NodeDropped,
    Rendezvous,
    RendezvousEvent,
    RendezvousSettings,
    Round,
    RoundClosed,
    RoundFormed,
    global_ranks,
)

LAST_CALL = 1_000


def rdzv(**kw: int) -> Rendezvous:
    return Rendezvous(RendezvousSettings(**{"last_call_timeout_ms": LAST_CALL, **kw}))


def join(r: Rendezvous, node: str, now: int, lws: int = 1) -> list[RendezvousEvent]:
    return r.join(node, lws, f"host-{node}", 1000 + len(node), now)


def formed(events: list[RendezvousEvent]) -> RoundFormed | None:
    rounds = [e for e in events if isinstance(e, RoundFormed)]
    return rounds[-1] if rounds else None


def test_round_forms_at_once_when_max_nodes_joined() -> None:
    r = rdzv(min_nodes=2, max_nodes=3)
    join(r, "a", 0)
    join(r, "b", 10)
    round_ = formed(join(r, "c", 20))
    assert round_ is not None and round_.round == 1
    assert [m.node_id for m in round_.members] == ["a", "b", "c"]


def test_round_forms_after_last_call_once_min_nodes_joined() -> None:
    r = rdzv(min_nodes=2, max_nodes=4)
    join(r, "a", 0)
    assert formed(join(r, "b", 100)) is None
    assert r.next_deadline() == 100 + LAST_CALL
    assert formed(r.tick(100 + LAST_CALL - 1)) is None
    round_ = formed(r.tick(100 + LAST_CALL))
    assert round_ is not None and round_.members[1].node_id == "b"


def test_a_join_during_last_call_restarts_the_last_call() -> None:
    r = rdzv(min_nodes=1, max_nodes=4)
    join(r, "a", 0)
    join(r, "b", 900)
    assert formed(r.tick(1_000)) is None
    assert formed(r.tick(1_900)) is not None


def test_size_is_rounded_down_to_node_unit_and_the_rest_wait() -> None:
    r = rdzv(min_nodes=2, max_nodes=8, node_unit=2)
    for i, node in enumerate("abcde"):
        join(r, node, i)
    round_ = formed(r.tick(5 + LAST_CALL))
    assert round_ is not None and len(round_.members) == 4
    assert r.num_nodes_waiting() == 1
    assert r.assignment("e") is None


def test_a_late_node_waits_and_closes_a_round_that_can_grow() -> None:
    r = rdzv(min_nodes=1, max_nodes=2)
    join(r, "a", 0)
    first = formed(r.tick(LAST_CALL))
    assert first is not None
    events = join(r, "b", 5_000)
    closed = [e for e in events if isinstance(e, RoundClosed)]
    assert closed and closed[0].round == 1 and "b is waiting" in closed[0].reason
    assert r.assignment("a") is None, "members must re-rendezvous"
    # The round forms as soon as the expected member is back: no last call.
    second = formed(join(r, "a", 5_010))
    assert second is not None and second.round == 2
    assert [m.node_id for m in second.members] == ["a", "b"]


def test_a_join_that_lost_its_answer_gets_the_round_again_and_changes_nothing() -> None:
    """A session's join says which round it was last answered with: a member
    of a newer round lost that round's answer; a member of the round it knows
    is joining again, which closes that round."""
    r = rdzv(min_nodes=2, max_nodes=2)
    join(r, "a", 0)
    first = formed(join(r, "b", 0))
    assert first is not None and first.round == 1
    # a's answer to round 1 was lost: asking again changes nothing.
    assert r.join("a", 1, "host-a", 1001, 10, answered_round=0) == []
    active = r.state.active
    assert active is not None and active.round == 1
    # a was answered round 1 and joins again: its round is over.
    events = r.join("a", 1, "host-a", 1001, 20, answered_round=1)
    closed = [e for e in events if isinstance(e, RoundClosed)]
    assert closed and closed[0].round == 1 and "a re-joined" in closed[0].reason
    # A join call (no answered round) by a member closes its round too.
    formed(join(r, "b", 30))
    again = r.state.active
    assert again is not None and again.round == 2
    closed = [e for e in join(r, "b", 40) if isinstance(e, RoundClosed)]
    assert closed and closed[0].round == 2


def test_a_late_node_is_a_spare_when_the_round_is_full() -> None:
    r = rdzv(min_nodes=2, max_nodes=2)
    join(r, "a", 0)
    formed_round = formed(join(r, "b", 0))
    assert formed_round is not None
    events = join(r, "c", 10)
    assert not any(isinstance(e, RoundClosed) for e in events)
    assert r.state.active is not None and r.num_nodes_waiting() == 1
    # A member dies: the spare takes its place in the next round.
    r.remove("b", "died", 20)
    round_ = formed(join(r, "a", 30))
    assert round_ is not None and {m.node_id for m in round_.members} == {"a", "c"}


def test_a_finished_member_leaves_the_round_open_until_every_member_finished() -> None:
    r = rdzv(min_nodes=1, max_nodes=2)
    join(r, "a", 0)
    join(r, "b", 0)
    active = r.state.active
    assert active is not None
    assert not any(isinstance(e, RoundClosed) for e in r.remove("a", "succeeded", 10, False))
    assert r.state.active is active  # b is still in its last steps
    events = r.remove("b", "succeeded", 20, close_round=False)
    assert any(isinstance(e, RoundClosed) and e.expected == () for e in events)
    # The training is done: a node that comes later (a relaunch that was
    # still starting) is told so instead of training afresh on its own.
    with pytest.raises(TrainingDone, match=r"^training done: round 1 ended with every member"):
        join(r, "c", 30)
    assert r.state.active is None and not r.state.waiting
    assert r.tick(30 + LAST_CALL) == []


def test_nodes_waiting_when_the_last_member_finishes_are_refused_with_why() -> None:
    r = rdzv(min_nodes=1, max_nodes=1)
    journal = join(r, "a", 0) + r.tick(LAST_CALL)
    journal += join(r, "b", LAST_CALL + 5)  # waits: the round is full
    events = r.remove("a", "succeeded", LAST_CALL + 10, close_round=False)
    dropped = [e for e in events if isinstance(e, NodeDropped)]
    assert [e.node_id for e in dropped] == ["b"]
    assert dropped[0].reason.startswith(TRAINING_DONE_REFUSAL)
    assert not r.state.waiting and r.state.active is None
    # A master that restarts replays it: the job stays done.
    replay = Rendezvous(r.settings)
    for event in journal + events:
        replay.apply(RendezvousEvent.from_json(event.to_json()))
    assert replay.state.done_reason == r.state.done_reason != ""


def test_a_dead_member_closes_the_round_and_survivors_reform_without_last_call() -> None:
    r = rdzv(min_nodes=1, max_nodes=3)
    for node in "abc":
        join(r, node, 0)
    assert r.state.active is not None
    events = r.remove("b", "died", 100)
    assert any(isinstance(e, RoundClosed) and "b died" in e.reason for e in events)
    assert all(e.gone_ranks == () for e in events if isinstance(e, RoundClosed))
    assert formed(join(r, "c", 110)) is None
    round_ = formed(join(r, "a", 120))
    assert round_ is not None and round_.round == 2 and len(round_.members) == 2


def test_surviving_nodes_keep_their_relative_rank_order() -> None:
    r = rdzv(min_nodes=1, max_nodes=4)
    for node in "abcd":
        join(r, node, 0)
    r.remove("a", "died", 10)
    join(r, "e", 11)  # a newcomer: ranks after the survivors
    for node in "dcb":
        join(r, node, 20)
    round_ = r.state.active
    assert round_ is not None
    assert [m.node_id for m in round_.members] == ["b", "c", "d", "e"]


def test_stale_round_is_rejected_and_changes_nothing() -> None:
    r = rdzv(min_nodes=1, max_nodes=1)
    join(r, "a", 0)
    assert r.check_member("a", 1).round == 1
    r.remove("a", "left", 1)
    join(r, "a", 2)
    before = dataclasses.asdict(r.state)
    with pytest.raises(StaleError, match="round 1 is stale"):
        r.check_member("a", 1)
    with pytest.raises(StaleError, match="not a member"):
        r.check_member("zz", 2)
    assert dataclasses.asdict(r.state) == before


def test_join_timeout_drops_nodes_waiting_for_a_round_that_cannot_form() -> None:
    r = rdzv(min_nodes=3, max_nodes=3, join_timeout_ms=5_000)
    join(r, "a", 0)
    join(r, "b", 1_000)
    events = r.tick(5_000)
    dropped = [e for e in events if isinstance(e, NodeDropped)]
    assert [e.node_id for e in dropped] == ["a"]
    assert "join_timeout" in r.state.dropped["a"]


def test_global_ranks_are_prefix_sums_of_local_world_sizes() -> None:
    r = rdzv(min_nodes=3, max_nodes=3)
    join(r, "a", 0, lws=2)
    join(r, "b", 0, lws=1)
    join(r, "c", 0, lws=3)
    round_ = r.state.active
    assert round_ is not None
    assert [list(global_ranks(round_, n)) for n in "abc"] == [[0, 1], [2], [3, 4, 5]]
    assert (round_.bootstrap_host, round_.bootstrap_port) == ("host-a", 1001)
    assert round_.size_runs == ((2, 1), (1, 1), (3, 1))


def test_equal_local_world_sizes_are_one_run() -> None:
    members = tuple(Member(f"n{i}", i, 8, "h", "") for i in range(1000))
    assert Round(1, members, "h", 1, 0).size_runs == ((8, 1000),)
    mixed = (*members[:2], Member("x", 2, 4, "h", ""), *members[3:5])
    assert Round(1, mixed, "h", 1, 0).size_runs == ((8, 2), (4, 1), (8, 2))


def ring(keepers: list[str]) -> Round:
    members = tuple(Member(f"n{i}", i, 1 + i % 2, "h", k) for i, k in enumerate(keepers))
    return Round(1, members, "h", 1, 0)


def ring_peer_by_scan(keepers: list[str], rank: int) -> str:
    """The rule, plainly: the next rank after `rank`, cyclically, with a Keeper."""
    n = len(keepers)
    return next((keepers[(rank + h) % n] for h in range(1, n) if keepers[(rank + h) % n]), "")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["", "", "k1", "k2", "k3"]), min_size=1, max_size=12))
def test_each_member_copies_to_the_next_keeper_by_group_rank(keepers: list[str]) -> None:
    round_ = ring(keepers)
    for member in round_.members:
        assert round_.keeper_peer(member) == ring_peer_by_scan(keepers, member.group_rank)


def test_a_members_rank_offset_is_the_prefix_sum_before_it() -> None:
    round_ = ring(["a", "", "b", "c"])  # local world sizes 1, 2, 1, 2
    assert [round_.rank_offset(m) for m in round_.members] == [0, 1, 3, 4]
    assert round_.world_processes == 6
    assert [round_.keeper_peer(m) for m in round_.members] == ["b", "b", "c", "a"]


@pytest.mark.parametrize(
    "kw",
    [
        {"min_nodes": 0},
        {"min_nodes": 3, "max_nodes": 2},
        {"min_nodes": 3, "max_nodes": 3, "node_unit": 2},
        {"node_unit": 0},
        {"join_timeout_ms": 0},
    ],
)
def test_bad_settings_are_invalid_argument(kw: dict[str, int]) -> None:
    with pytest.raises(InvalidArgument):
        RendezvousSettings(**kw)


def test_bad_joins_are_invalid_argument_and_change_nothing() -> None:
    r = rdzv(min_nodes=2, max_nodes=2)
    before = dataclasses.asdict(r.state)
    for bad in (("", 1, 0), ("a", 0, 0), ("a", 1, 70000)):
        with pytest.raises(InvalidArgument):
            r.join(bad[0], bad[1], "h", bad[2], 0)
    assert dataclasses.asdict(r.state) == before


def test_a_round_carries_each_members_keeper_address_by_group_rank() -> None:
    r = rdzv(min_nodes=2, max_nodes=2)
    r.join("a", 1, "host-a", 1000, 0, keeper_address="host-a:7000")
    round_ = formed(r.join("b", 1, "host-b", 1001, 10))
    assert round_ is not None
    assert [(m.node_id, m.keeper_address) for m in round_.members] == [
        ("a", "host-a:7000"),
        ("b", ""),
    ]


def test_a_bad_keeper_address_is_invalid_argument() -> None:
    r = rdzv()
    with pytest.raises(InvalidArgument, match="keeper_address"):
        r.join("a", 1, "h", 1000, 0, keeper_address="x" * 2000)
    with pytest.raises(InvalidArgument, match="keeper_address"):
        r.join("a", 1, "h", 1000, 0, keeper_address="h:1\n")
    assert r.state.waiting == {}


def test_journal_entries_written_before_keeper_addresses_still_replay() -> None:
    old = [
        '{"t":"NodeJoined","participant":{"node_id":"a","local_world_size":1,'
        '"host":"h","port":1000,"joined_ms":0}}',
        '{"t":"RoundFormed","round":1,"members":[{"node_id":"a","group_rank":0,'
        '"local_world_size":1,"host":"h"}],"bootstrap_host":"h","bootstrap_port":1000,'
        '"formed_ms":0}',
    ]
    r = rdzv()
    for text in old:
        r.apply(RendezvousEvent.from_json(text))
    assert r.state.active is not None
    assert r.state.active.members[0].keeper_address == ""


def test_an_event_is_journaled_as_its_type_and_fields_as_asdict_gives_them() -> None:
    r = rdzv(min_nodes=2, max_nodes=2)
    events = join(r, "a", 0) + join(r, "b", 1)
    events += r.join("k\u00e9", 3, 'h"ost', 7, 9, keeper_address="h:1")  # spare, escaped
    events += r.remove("b", "died", 2)
    events += r.remove("a", "left \u00e9", 3)
    assert {type(e).__name__ for e in events} >= {
        "NodeJoined", "RoundFormed", "RoundClosed", "NodeDropped"
    }  # fmt: skip

    for event in events:
        data = dataclasses.asdict(event)
        expected = json.dumps({"t": type(event).__name__, **data}, separators=(",", ":"))
        assert event.to_json() == expected


def test_after_a_restart_a_waiting_node_is_not_formed_into_a_round_until_it_joins_again() -> None:
    # The earlier run's node "old" waited alone for a round of 2 when its
    # master died; the new master runs rounds of 1. Registered (its record
    # recovered), it must still join again to be counted: it may be dead.
    r = rdzv(min_nodes=2, max_nodes=2)
    join(r, "old", 0)
    r = replayed(r, rdzv(min_nodes=1, max_nodes=1))
    r.restarted({"old"}, 10_000)
    assert r.state.waiting == {}
    assert formed(r.tick(10_000 + 10 * LAST_CALL)) is None
    round_ = formed(join(r, "new", 20_000)) or formed(r.tick(20_000 + LAST_CALL))
    assert round_ is not None and [m.node_id for m in round_.members] == ["new"]


def test_after_a_restart_the_survivors_of_a_closed_round_are_still_expected_back() -> None:
    r = rdzv(min_nodes=1, max_nodes=3)
    for node in "abc":
        join(r, node, 0)
    r.remove("c", "died", 100)
    join(r, "a", 110)  # b has not re-joined when the master dies
    r.restarted({"a", "b"}, 200)
    assert r.state.expected == {"a", "b"} and not r.state.waiting
    assert formed(join(r, "a", 210)) is None
    round_ = formed(join(r, "b", 220))  # everyone back: no last call to wait out
    assert round_ is not None and {m.node_id for m in round_.members} == {"a", "b"}


def test_after_a_restart_a_member_the_node_table_lost_closes_its_round() -> None:
    r = rdzv(min_nodes=1, max_nodes=2)
    join(r, "a", 0)
    join(r, "b", 0)
    r.remove("b", "succeeded", 5, close_round=False)  # finished: leaves no gap
    events = r.restarted({"a"}, 10)  # b finished; a is registered
    assert events == [] and r.state.active is not None
    events = r.restarted(set(), 20)  # a was lost just before the restart
    assert any(
        isinstance(e, RoundClosed) and "a is not registered with the restarted master" in e.reason
        for e in events
    )
    assert r.state.active is None and r.state.expected == set()


def replayed(r: Rendezvous, fresh: Rendezvous) -> Rendezvous:
    """`fresh` (a restarted master's settings) with `r`'s state, as replay gives it."""
    fresh.state = r.state
    return fresh


class RendezvousMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.journal: list[str] = []
        self.r = Rendezvous()

    @initialize(low=st.integers(1, 4), extra=st.integers(0, 3), unit=st.integers(1, 2))
    def configure(self, low: int, extra: int, unit: int) -> None:
        high = low + extra
        if high // unit * unit < low:
            unit = 1
        self.r = Rendezvous(
            RendezvousSettings(low, high, unit, last_call_timeout_ms=50, join_timeout_ms=400)
        )

    def _record(self, events: list[RendezvousEvent]) -> None:
        self.journal += [e.to_json() for e in events]

    @rule(node=st.sampled_from("abcdefg"), lws=st.integers(1, 3))
    def join(self, node: str, lws: int) -> None:
        try:
            self._record(self.r.join(node, lws, "h", 5, self.now))
        except TrainingDone:
            assert self.r.state.done_reason  # only once a round ended complete

    @rule(node=st.sampled_from("abcdefg"))
    def dies(self, node: str) -> None:
        self._record(self.r.remove(node, "died", self.now))

    @rule(node=st.sampled_from("abcdefg"))
    def finishes(self, node: str) -> None:
        self._record(self.r.remove(node, "succeeded", self.now, close_round=False))

    @rule(registered=st.sets(st.sampled_from("abcdefg")))
    def master_restarts(self, registered: set[str]) -> None:
        self._record(self.r.restarted(registered, self.now))
        assert not self.r.state.waiting
        active = self.r.state.active
        members = {m.node_id for m in active.members} if active is not None else set()
        assert members - self.r.state.finished <= registered
        assert self.r.state.expected <= registered

    @rule(dt=st.integers(1, 200))
    def time_passes(self, dt: int) -> None:
        self.now += dt
        self._record(self.r.tick(self.now))

    @rule(round_=st.integers(0, 20), node=st.sampled_from("abcdefg"))
    def fencing_never_changes_state(self, round_: int, node: str) -> None:
        before = dataclasses.asdict(self.r.state)
        with contextlib.suppress(StaleError):
            self.r.check_member(node, round_)
        assert dataclasses.asdict(self.r.state) == before

    @invariant()
    def active_round_is_well_formed(self) -> None:
        s, cfg = self.r.state, self.r.settings
        if s.active is None:
            return
        ranks = [m.group_rank for m in s.active.members]
        assert ranks == list(range(len(ranks)))
        assert cfg.min_nodes <= s.active.world_size <= cfg.max_nodes
        assert s.active.world_size % cfg.node_unit == 0
        assert not {m.node_id for m in s.active.members} & set(s.waiting)
        assert s.finished < {m.node_id for m in s.active.members}  # all done: closed

    @invariant()
    def nothing_forms_or_waits_once_the_training_is_done(self) -> None:
        s = self.r.state
        if s.done_reason:
            assert s.active is None and not s.waiting

    @invariant()
    def journal_replay_rebuilds_the_state(self) -> None:
        replayed = Rendezvous(self.r.settings)
        for text in self.journal:
            replayed.apply(RendezvousEvent.from_json(text))
        assert dataclasses.asdict(replayed.state) == dataclasses.asdict(self.r.state)


RendezvousMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestRendezvousMachine = RendezvousMachine.TestCase


def test_below_min_nodes_the_next_deadline_is_the_join_timeout_not_a_passed_last_call() -> None:
    # A last call that is over cannot form a round below min_nodes: the timer
    # must sleep until the join timeout, not spin on a deadline in the past.
    r = rdzv(min_nodes=3, max_nodes=4, join_timeout_ms=60_000)
    join(r, "a", 0)
    join(r, "b", 100)
    assert r.next_deadline() == 60_000
    assert formed(r.tick(100 + LAST_CALL)) is None
    join(r, "c", 5_000)
    assert r.next_deadline() == 5_000 + LAST_CALL


def test_a_dropped_latest_joiner_moves_the_last_call_back_to_the_one_before() -> None:
    r = rdzv(min_nodes=1, max_nodes=4)
    join(r, "a", 0)
    join(r, "b", 500)
    r.remove("b", "died", 600)
    assert r.next_deadline() == LAST_CALL
    assert formed(r.tick(LAST_CALL)) is not None


def test_a_round_of_thousands_forms_once_every_survivor_is_back() -> None:
    nodes = [f"n{i}" for i in range(3_000)]
    r = rdzv(min_nodes=2_000, max_nodes=3_000)
    for i, node in enumerate(nodes):
        join(r, node, i)
    first = r.state.active
    assert first is not None and first.member("n2999") is not None
    assert formed(r.remove("n7", "died", 4_000)) is None
    survivors = [n for n in nodes if n != "n7"]
    for node in survivors[:-1]:
        assert formed(join(r, node, 5_000)) is None
    again = formed(join(r, survivors[-1], 5_000))
    assert again is not None and len(again.members) == 2_999
    # Survivors keep their order: n8 moves up into n7's rank.
    assert [m.node_id for m in again.members[6:9]] == ["n6", "n8", "n9"]


def test_waiting_nodes_are_told_who_waits_how_many_a_round_needs_and_until_when() -> None:
    rdzv = Rendezvous(
        RendezvousSettings(min_nodes=3, max_nodes=4, last_call_timeout_ms=2_000,
                           join_timeout_ms=60_000)
    )  # fmt: skip
    assert rdzv.why_waiting(0) == ""
    rdzv.join("b#1", 1, "10.0.0.3", 29500, now_ms=0)
    rdzv.join("a#1", 1, "10.0.0.2", 29500, now_ms=1_000)
    assert rdzv.why_waiting(10_000) == (
        "2 node(s) waiting (a#1, b#1); a round needs min_nodes 3: waiting for 1 more, "
        "at most 50s more (join_timeout)"
    )
    rdzv.join("c#1", 1, "10.0.0.4", 29500, now_ms=10_500)
    assert rdzv.why_waiting(11_000) == (
        "3 node(s) waiting (a#1, b#1, c#1); a round of 3 forms in 1.5s (last call) unless "
        "more join, at once with max_nodes 4"
    )
    rdzv.tick(12_500)
    assert rdzv.state.active is not None and rdzv.why_waiting(12_500) == ""


def test_a_node_beyond_max_nodes_is_told_it_waits_for_the_round_to_re_form() -> None:
    rdzv = Rendezvous(RendezvousSettings(min_nodes=1, max_nodes=1))
    rdzv.join("a#1", 1, "10.0.0.2", 29500, now_ms=0)
    rdzv.join("b#1", 1, "10.0.0.3", 29500, now_ms=100)
    assert rdzv.why_waiting(200) == (
        "1 node(s) waiting (b#1); round 1 runs with 1 node(s), max_nodes 1: they join when "
        "it re-forms (a node leaves or fails)"
    )


def test_a_member_that_died_closes_its_round_naming_its_ranks_gone() -> None:
    """Its ranks by torchrun's rule (prefix sums of the local world sizes),
    kept through the journal."""
    r = rdzv(min_nodes=1, max_nodes=3)
    for node, lws in (("a", 2), ("b", 3), ("c", 1)):
        join(r, node, 0, lws)
    active = r.state.active
    assert active is not None
    member = active.member("b")
    assert member is not None
    start = active.rank_offset(member)
    events = r.remove("b", "lost its session", 100, died=True)
    closed = [e for e in events if isinstance(e, RoundClosed)]
    assert [e.gone_ranks for e in closed] == [(start, start + 1, start + 2)]
    assert RendezvousEvent.from_json(closed[0].to_json()) == closed[0]
