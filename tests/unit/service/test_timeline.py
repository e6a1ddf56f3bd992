"""The master's in-memory timeline: bounded, ordered, read by sequence."""

from __future__ import annotations

import pytest

from dlfleet.master.service.timeline import EventKind, Timeline


def test_a_full_timeline_drops_its_oldest_entries_but_never_reuses_a_seq() -> None:
    timeline = Timeline(capacity=3)
    for n in range(5):
        timeline.record(EventKind.NODE_LOST, 1_000 + n, node_id=f"n{n}#1", reason="left")
    assert [e.seq for e in timeline.since()] == [3, 4, 5]
    assert timeline.last_seq == 5
    assert [e.seq for e in timeline.since(4)] == [5]
    assert timeline.since(1, limit=1)[0].seq == 3


def test_an_entry_reads_as_flat_json() -> None:
    entry = Timeline().record(EventKind.ROUND_CLOSED, 7, round=2, reason="node-a#1 left")
    assert entry.to_json() == {
        "seq": 1,
        "at_ms": 7,
        "kind": "round_closed",
        "round": 2,
        "reason": "node-a#1 left",
    }


def test_a_timeline_holds_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Timeline(capacity=0)
