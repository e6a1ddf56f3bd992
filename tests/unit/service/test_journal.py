"""The journal: any mix of the cores' events in one append, each in its
stream; shard events shown to the metrics hook; streams checkpointed every so
many entries; and the three ways to wait for a write."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dlfleet.master.core.checkpoint_events import CopiesReported, ImageCopy
from dlfleet.master.core.checkpoints import CheckpointTable
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.events import Event
from dlfleet.master.core.node_events import NodeForgotten, NodeRegistered
from dlfleet.master.core.rendezvous import NodeDropped
from dlfleet.master.core.shards import RankConsumer, ShardBook
from dlfleet.master.service.journal import (
    CHECKPOINT,
    CHECKPOINT_TABLE,
    CHECKPOINTS_STREAM,
    DATASET_PREFIX,
    NODES_STREAM,
    RENDEZVOUS_STREAM,
    Journal,
    JournalEvent,
)
from dlfleet.master.store.base import StateStore, StreamState


class RecordingStore(StateStore):
    """Keeps every append (one list per transaction) and every checkpoint."""

    def __init__(self) -> None:
        self.appends: list[list[tuple[str, str]]] = []
        self.checkpoints: list[tuple[str, str, int]] = []
        self._seq = 0
        self._lock = threading.Lock()

    def append(self, entries: Sequence[tuple[str, str]]) -> int:
        with self._lock:
            self.appends.append(list(entries))
            self._seq += len(entries)
            return self._seq

    def load(self) -> dict[str, StreamState]:
        return {}

    def checkpoint(self, stream: str, payload: str, upto_seq: int) -> None:
        with self._lock:
            self.checkpoints.append((stream, payload, upto_seq))

    def close(self) -> None:
        """Nothing to release: the entries live in lists."""

    def entries(self) -> list[tuple[str, str]]:
        return [entry for append in self.appends for entry in append]


class Cores:
    def __init__(self, store: RecordingStore, **compaction: int) -> None:
        self.store = store
        self.book = ShardBook()
        self.checkpoints = CheckpointTable()
        settings = {"compact_every": 10**9, "checkpoints_compact_every": 10**9, **compaction}
        self.journal = Journal(store, self.book, self.checkpoints, **settings)
        self.shown: list[Event] = []
        self.journal.on_events = self.shown.extend


@pytest.fixture
def cores() -> Iterator[Cores]:
    made = Cores(RecordingStore())
    yield made
    made.journal.close()


def dataset(book: ShardBook, name: str = "d") -> list[Event]:
    config = DatasetConfig.create(name=name, size=100, batch_size=5, shard_size=10)
    return book.register(config)[1]


def test_one_append_of_every_cores_events_lands_in_one_transaction_each_in_its_stream(
    cores: Cores,
) -> None:
    shard_events = dataset(cores.book)
    copy = ImageCopy(0, "n#1", "n:1", False, 10)
    checkpoint_events = [CopiesReported("n#1", 1, 1, 1, (copy,))]
    mixed: list[JournalEvent] = [
        NodeForgotten("n", 1, 2, "h"),
        *shard_events,
        *checkpoint_events,
        NodeDropped("n#1", "left"),
        NodeRegistered("n", 2, 2, "h", 5),
    ]
    cores.journal.append(mixed).result()
    assert len(cores.store.appends) == 1
    assert cores.store.appends[0] == [
        (NODES_STREAM, mixed[0].to_json()),
        (DATASET_PREFIX + "d", shard_events[0].to_json()),
        (CHECKPOINTS_STREAM, checkpoint_events[0].to_json()),
        (RENDEZVOUS_STREAM, mixed[-2].to_json()),
        (NODES_STREAM, mixed[-1].to_json()),
    ]
    assert cores.shown == shard_events  # the metrics hook sees the shard events only


def test_an_empty_append_still_waits_for_what_was_queued_before_it(cores: Cores) -> None:
    cores.journal.append_detached(dataset(cores.book))
    assert cores.journal.append([]).result() == 1
    assert len(cores.store.entries()) == 1


def test_a_sink_is_told_the_seq_of_its_append(cores: Cores) -> None:
    told: list[tuple[object, int | BaseException]] = []
    done = threading.Event()

    class Sink:
        def committed(self, outcomes: list[tuple[object, int | BaseException]]) -> None:
            told.extend(outcomes)
            done.set()

    cores.journal.append_to(dataset(cores.book), Sink(), "token")
    assert done.wait(5)
    assert told == [("token", 1)]


def test_an_object_of_no_core_is_refused_before_anything_is_queued(cores: Cores) -> None:
    stranger: Any = "not an event"
    with pytest.raises(TypeError, match="no journal stream"):
        cores.journal.append([stranger])
    assert cores.journal.append([]).result() == 0
    assert cores.store.entries() == []


def test_a_dataset_stream_is_checkpointed_every_compact_every_entries() -> None:
    cores = Cores(RecordingStore(), compact_every=4)
    try:
        events = dataset(cores.book)
        for n in range(5):
            events += cores.book.lease("d", RankConsumer("c", 0), n)[1]
        cores.journal.append(events).result()
        cores.journal.append([]).result()
        payloads = [json.loads(p) for s, p in cores.store.entries() if s == DATASET_PREFIX + "d"]
        assert [p["t"] for p in payloads].count(CHECKPOINT) == 1  # one per append at most
        assert payloads[-1]["t"] == CHECKPOINT
        stream, payload, upto = cores.store.checkpoints[0]
        assert (stream, json.loads(payload)["t"], upto) == (DATASET_PREFIX + "d", CHECKPOINT, 7)
    finally:
        cores.journal.close()


def test_the_checkpoints_stream_is_checkpointed_as_a_snapshot_of_the_table() -> None:
    cores = Cores(RecordingStore(), checkpoints_compact_every=2)
    try:
        for step in range(2):
            copy = ImageCopy(0, "n#1", "n:1", False, 10)
            event = CopiesReported("n#1", step, 1, 1, (copy,))
            cores.checkpoints.apply(event)
            cores.journal.append([event]).result()
        cores.journal.append([]).result()
        stream, payload, upto = cores.store.checkpoints[0]
        assert (stream, upto) == (CHECKPOINTS_STREAM, 3)
        assert json.loads(payload) == {
            "t": CHECKPOINT_TABLE,
            "state": cores.checkpoints.to_dict(),
        }
    finally:
        cores.journal.close()


def test_a_stream_replayed_past_its_compaction_point_is_checkpointed_at_the_next_append() -> None:
    cores = Cores(RecordingStore(), compact_every=100)
    try:
        events = dataset(cores.book)
        cores.journal.replayed(DATASET_PREFIX + "d", 500)
        cores.journal.append(events).result()
        cores.journal.append([]).result()
        assert [stream for stream, _, _ in cores.store.checkpoints] == [DATASET_PREFIX + "d"]
    finally:
        cores.journal.close()
