"""The journal form of shard events: what the master writes before it answers."""

from __future__ import annotations

import dataclasses
import json

from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.events import Event
from dlfleet.master.core.shards import RankConsumer, RoundConsumer, ShardBook, ShardSettings


def _events_of_a_short_job() -> list[Event]:
    book = ShardBook(ShardSettings(lease_timeout_ms=100))
    config = DatasetConfig.create(name="ds", size=30, batch_size=2, shard_size=10)
    events = book.register(config)[1]
    first, more = book.lease("ds", RankConsumer("a#1", 0), 0, "req-1")
    events += more
    assert first.shard is not None
    events += book.report_failure("ds", first.shard.lease_id, 0, 4, "bad record", 1)
    second, more = book.lease("ds", RankConsumer("a#1", 0), 2, "req-2")
    events += more
    assert second.shard is not None
    events += book.lease("ds", RankConsumer("a#1", 0), 3, "req-3", [second.shard.lease_id])[1]
    events += book.lease("ds", RoundConsumer(round=1, position=0), 4)[1]
    events += book.expire(10_000)
    return events


def test_an_event_is_written_as_its_type_and_fields_in_compact_json() -> None:
    events = _events_of_a_short_job()
    assert len({type(event) for event in events}) >= 6

    for event in events:
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        expected = json.dumps({"t": type(event).__name__, **fields}, separators=(",", ":"))
        assert event.to_json() == expected
        assert Event.from_json(event.to_json()) == event
