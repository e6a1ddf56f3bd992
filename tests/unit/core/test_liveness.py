"""NodeTable: every registration is a new incarnation; older incarnations are
stale; a node silent for longer than the timeout is reported dead once."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from dlfleet.api.errors import InvalidArgument, StaleError
from dlfleet.master.core.liveness import MAX_NODE_NAME, LivenessSettings, NodeRecord, NodeTable
from dlfleet.master.core.node_events import NodeEvent, NodeForgotten, NodeRegistered

TIMEOUT = 1_000


def table() -> NodeTable:
    return NodeTable(LivenessSettings(heartbeat_interval_ms=100, heartbeat_timeout_ms=TIMEOUT))


def register(
    nodes: NodeTable, name: str, local_world_size: int, host: str, now_ms: int
) -> NodeRecord:
    """The record of a new incarnation (the events are the journal's)."""
    return nodes.register(name, local_world_size, host, now_ms)[0]


def expired(nodes: NodeTable, now_ms: int) -> list[str]:
    return [event.node_id for event in nodes.expire(now_ms)]


def test_registering_the_same_name_again_gives_the_next_incarnation() -> None:
    nodes = table()
    records = [register(nodes, "worker-0", 8, "host-a", now_ms=t) for t in (0, 10, 20)]
    assert [r.incarnation for r in records] == [1, 2, 3]
    assert [r.node_id for r in records] == ["worker-0#1", "worker-0#2", "worker-0#3"]
    assert nodes.nodes["worker-0"] is records[-1]


def test_incarnations_are_counted_per_name() -> None:
    nodes = table()
    register(nodes, "a", 1, "h", now_ms=0)
    assert register(nodes, "b", 1, "h", now_ms=0).node_id == "b#1"
    assert register(nodes, "a", 1, "h", now_ms=0).node_id == "a#2"


def test_a_registration_records_what_the_node_said() -> None:
    record = register(table(), "n", 4, "10.0.0.7", now_ms=123)
    assert (record.name, record.local_world_size, record.host, record.last_seen_ms) == (
        "n",
        4,
        "10.0.0.7",
        123,
    )


def test_incarnations_keep_counting_after_the_node_expired() -> None:
    nodes = table()
    register(nodes, "n", 1, "h", now_ms=0)
    assert [r.node_id for r in nodes.expire(now_ms=TIMEOUT + 1)] == ["n#1"]
    assert register(nodes, "n", 1, "h", now_ms=TIMEOUT + 2).incarnation == 2


def test_heartbeat_of_an_older_incarnation_is_stale() -> None:
    nodes = table()
    old = register(nodes, "n", 1, "h", now_ms=0)
    new = register(nodes, "n", 1, "h", now_ms=5)
    with pytest.raises(StaleError):
        nodes.heartbeat(old.node_id, old.incarnation, now_ms=10)
    nodes.heartbeat(new.node_id, new.incarnation, now_ms=10)
    assert nodes.nodes["n"].last_seen_ms == 10


@pytest.mark.parametrize(
    ("node_id", "incarnation"),
    [("n#1", 2), ("n#2", 1), ("m#1", 1), ("n", 1), ("", 1)],
)
def test_heartbeat_with_a_mismatched_id_or_incarnation_is_stale(
    node_id: str, incarnation: int
) -> None:
    nodes = table()
    register(nodes, "n", 1, "h", now_ms=0)
    with pytest.raises(StaleError):
        nodes.heartbeat(node_id, incarnation, now_ms=1)
    assert nodes.nodes["n"].last_seen_ms == 0


def test_heartbeat_never_moves_last_seen_backwards() -> None:
    nodes = table()
    record = register(nodes, "n", 1, "h", now_ms=500)
    nodes.heartbeat(record.node_id, 1, now_ms=100)
    assert record.last_seen_ms == 500


def test_a_node_silent_for_exactly_the_timeout_is_still_alive() -> None:
    nodes = table()
    register(nodes, "n", 1, "h", now_ms=0)
    assert nodes.expire(now_ms=TIMEOUT) == []
    assert "n" in nodes.nodes


def test_a_node_silent_longer_than_the_timeout_expires_exactly_once() -> None:
    nodes = table()
    record = register(nodes, "n", 1, "h", now_ms=0)
    assert expired(nodes, now_ms=TIMEOUT + 1) == [record.node_id]
    assert expired(nodes, now_ms=TIMEOUT + 2) == []
    assert expired(nodes, now_ms=10 * TIMEOUT) == []
    assert "n" not in nodes.nodes


def test_a_node_that_beat_in_time_does_not_expire() -> None:
    nodes = table()
    beating = register(nodes, "beating", 1, "h", now_ms=0)
    silent = register(nodes, "silent", 1, "h", now_ms=0)
    for now in range(0, 5 * TIMEOUT, TIMEOUT // 2):
        nodes.heartbeat(beating.node_id, beating.incarnation, now_ms=now)
    assert expired(nodes, now_ms=5 * TIMEOUT) == [silent.node_id]
    assert list(nodes.nodes) == ["beating"]


def test_heartbeat_of_an_expired_node_is_stale() -> None:
    nodes = table()
    record = register(nodes, "n", 1, "h", now_ms=0)
    nodes.expire(now_ms=TIMEOUT + 1)
    with pytest.raises(StaleError):
        nodes.heartbeat(record.node_id, record.incarnation, now_ms=TIMEOUT + 2)


def test_a_forgotten_node_is_stale_and_never_expires() -> None:
    nodes = table()
    record = register(nodes, "n", 1, "h", now_ms=0)
    assert nodes.forget("n#1") == [NodeForgotten("n", 1, 1, "h")]
    assert nodes.forget("n#1") == []
    assert nodes.forget("never-registered#1") == []
    with pytest.raises(StaleError):
        nodes.live(record.node_id, record.incarnation)
    assert nodes.expire(now_ms=10 * TIMEOUT) == []


def test_a_restored_node_gets_a_full_timeout_and_keeps_its_incarnation() -> None:
    nodes = table()
    nodes.apply(NodeRegistered("n", 4, 2, "h", registered_ms=5_000))
    assert nodes.live("n#4", 4).last_seen_ms == 5_000
    assert nodes.expire(now_ms=5_000 + TIMEOUT) == []
    assert register(nodes, "n", 2, "h", now_ms=5_001).incarnation == 5


@pytest.mark.parametrize(
    "name",
    ["", "a#b", "#", "x" * (MAX_NODE_NAME + 1), "line\nbreak", "bell\x07"],
)
def test_bad_node_name_is_invalid_argument(name: str) -> None:
    nodes = table()
    with pytest.raises(InvalidArgument, match="node name"):
        register(nodes, name, 1, "h", now_ms=0)
    assert nodes.nodes == {}


def test_a_name_of_the_maximum_length_is_accepted() -> None:
    register(table(), "x" * MAX_NODE_NAME, 1, "h", now_ms=0)


@pytest.mark.parametrize("local_world_size", [0, -1, 1025])
def test_bad_local_world_size_is_invalid_argument(local_world_size: int) -> None:
    nodes = table()
    with pytest.raises(InvalidArgument, match="local_world_size"):
        register(nodes, "n", local_world_size, "h", now_ms=0)
    assert nodes.nodes == {}


def test_a_rejected_registration_does_not_use_up_an_incarnation() -> None:
    nodes = table()
    with pytest.raises(InvalidArgument):
        register(nodes, "n", 0, "h", now_ms=0)
    assert register(nodes, "n", 1, "h", now_ms=0).incarnation == 1


@pytest.mark.parametrize("local_world_size", [1, 1024])
def test_local_world_size_limits_are_accepted(local_world_size: int) -> None:
    assert register(table(), "n", local_world_size, "h", now_ms=0).local_world_size == (
        local_world_size
    )


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["register", "pending", "answer", "beat", "forget", "restore", "expire", "stall"]
            ),
            st.integers(0, 3),  # which node
            st.integers(0, 700),  # time passing before it, ms
        ),
        max_size=60,
    )
)
def test_expire_finds_exactly_the_nodes_a_scan_of_all_would(
    steps: list[tuple[str, int, int]],
) -> None:
    """Kept in heartbeat order, `expire` looks only at the silent nodes; with
    time going forward, and the master's stalls credited, it must find what
    checking every node finds."""
    nodes = table()
    now = 0
    # What each node was last heard at, in the master's attentive time.
    heard: dict[str, int] = {}
    waiting: set[str] = set()  # registered, not yet answered
    awaiting: list[str] = []  # answered, no beat since, in answer order
    stalled = 0
    for op, which, passed in steps:
        now += passed
        if op == "stall":  # the time that passed was a stall of the master
            nodes.credit_stall(passed)
            stalled += passed
            continue
        name = f"n{which}"
        record = nodes.nodes.get(name)
        if op in ("register", "pending"):
            nodes.register(name, 1, "h", now, pending=op == "pending")
            heard[name] = now - stalled
            waiting.discard(name)
            awaiting[:] = [n for n in awaiting if n != name]
            if op == "pending":
                waiting.add(name)
        elif op == "answer" and record is not None:
            nodes.answered(record.node_id, record.incarnation, now)
            heard[name] = now - stalled
            waiting.discard(name)
            if name not in awaiting:
                awaiting.append(name)
        elif op == "beat" and record is not None:
            nodes.heartbeat(record.node_id, record.incarnation, now)
            heard[name] = now - stalled
            if name in awaiting:  # its session taken: so were those answered before
                for earlier in awaiting[: awaiting.index(name)]:
                    heard[earlier] = now - stalled
                del awaiting[: awaiting.index(name) + 1]
        elif op == "forget":
            if record is not None:
                nodes.forget(record.node_id)
                awaiting[:] = [n for n in awaiting if n != name]
        elif op == "restore":
            nodes.apply(NodeRegistered(name, 7, 1, "h", now))
            heard[name] = now - stalled
            waiting.discard(name)
            awaiting[:] = [n for n in awaiting if n != name]
        elif op == "expire":
            silent = sorted(
                r.node_id
                for r in nodes.nodes.values()
                if r.name not in waiting and now - stalled - heard[r.name] > TIMEOUT
            )
            assert sorted(r.node_id for r in nodes.expire(now)) == silent
            awaiting[:] = [n for n in awaiting if n in nodes.nodes]
            assert all(n in waiting or now - stalled - heard[n] <= TIMEOUT for n in nodes.nodes)


def test_a_stall_of_the_master_is_not_counted_as_any_nodes_silence() -> None:
    nodes = table()
    a = register(nodes, "a", 1, "h", 0)
    b = register(nodes, "b", 1, "h", 500)
    # The master heard nobody from 600 to 3,600 (its loop stalled 3 s).
    nodes.credit_stall(3_000)
    assert expired(nodes, 3_600) == []  # a: 600 ms silent, not 3,600
    nodes.heartbeat(b.node_id, b.incarnation, 3_700)  # b's beat, queued, now heard
    assert expired(nodes, 4_000) == []  # a: 1,000 ms, exactly the timeout
    assert expired(nodes, 4_001) == [a.node_id]
    assert expired(nodes, 4_700) == []
    assert expired(nodes, 4_701) == [b.node_id]


def test_a_node_is_not_expired_before_its_registration_is_answered() -> None:
    nodes = table()
    a, _ = nodes.register("a", 1, "h", 0, pending=True)
    assert expired(nodes, 5_000) == []  # the commit took 5 s: a could not beat
    nodes.answered(a.node_id, a.incarnation, 5_000)
    assert expired(nodes, 6_000) == []
    assert expired(nodes, 6_001) == [a.node_id]
    nodes.answered(a.node_id, a.incarnation, 7_000)  # gone: nothing happens
    assert a.node_id not in {r.node_id for r in nodes.nodes.values()}


def test_an_answer_to_a_replaced_incarnation_changes_nothing() -> None:
    nodes = table()
    first, _ = nodes.register("a", 1, "h", 0, pending=True)
    nodes.register("a", 1, "h", 10, pending=True)
    nodes.answered(first.node_id, first.incarnation, 20)
    assert not nodes.nodes["a"].answered
    assert expired(nodes, 5_000) == []


def test_a_node_answered_is_not_blamed_until_a_later_ones_session_is_taken() -> None:
    nodes = table()
    a, _ = nodes.register("a", 1, "h", 0, pending=True)
    b, _ = nodes.register("b", 1, "h", 0, pending=True)
    nodes.answered(a.node_id, a.incarnation, 100)
    nodes.answered(b.node_id, b.incarnation, 200)
    # The master takes sessions late: b's first beat comes at 900, a's never.
    nodes.heartbeat(b.node_id, b.incarnation, 900)
    nodes.heartbeat(b.node_id, b.incarnation, 1_500)
    assert expired(nodes, 1_900) == []  # a counts from 900, not from 100
    assert expired(nodes, 1_901) == [a.node_id]


def test_a_negative_stall_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="not negative"):
        table().credit_stall(-1)


def test_a_registration_that_replaces_a_live_incarnation_forgets_it_first() -> None:
    nodes = table()
    old = register(nodes, "n", 2, "h", now_ms=0)
    record, events = nodes.register("n", 4, "h2", now_ms=7)
    assert events == [NodeForgotten("n", 1, 2, "h"), NodeRegistered("n", 2, 4, "h2", 7)]
    assert [event.node_id for event in events] == [old.node_id, record.node_id]
    assert nodes.forget(old.node_id) == []  # the older incarnation is gone already


def test_a_heartbeat_changes_no_event_and_replay_gives_a_full_timeout_from_the_event() -> None:
    live = table()
    events = live.register("a", 1, "h", now_ms=10)[1] + live.register("b", 2, "h", now_ms=20)[1]
    events += live.register("a", 3, "h", now_ms=30)[1]
    events += live.forget("b#1")
    replayed = table()
    for event in events:
        replayed.apply(event)
    assert replayed.nodes == live.nodes
    assert register(replayed, "a", 1, "h", now_ms=40).incarnation == 3
    assert register(replayed, "b", 1, "h", now_ms=40).incarnation == 2


@pytest.mark.parametrize(
    "event",
    [NodeRegistered("n", 3, 8, "10.0.0.1", registered_ms=1_234), NodeForgotten("n", 3, 8, "h")],
)
def test_node_events_round_trip_through_json(event: NodeRegistered | NodeForgotten) -> None:
    assert NodeEvent.from_json(event.to_json()) == event


def test_node_events_keep_the_nodes_streams_wire_format() -> None:
    """What the "nodes" stream held before these were events still reads."""
    old = '{"t": "node", "name": "n", "incarnation": 2, "local_world_size": 4, "host": "h"}'
    assert NodeEvent.from_json(old) == NodeRegistered("n", 2, 4, "h", registered_ms=0)
    gone = {"t": "node_gone", "name": "n", "incarnation": 2, "local_world_size": 4, "host": "h"}
    assert json.loads(NodeForgotten("n", 2, 4, "h").to_json()) == gone
    registered = json.loads(NodeRegistered("n", 2, 4, "h", registered_ms=5).to_json())
    assert registered == {**gone, "t": "node", "registered_ms": 5}
