"""A sync-mode loader's own snapshot (dlfleet.worker.loader.snapshot), for a
master that does not answer, is the master's: a round's consumer leases,
trains, acks and snapshots against the master's real shard core (ShardBook),
keeping the loader's real LeaseLedger; at random moments the snapshot the
loader computes from the last one the master gave is compared with the one
the master gives then. Random dataset shapes and operation sequences, across
epoch ends and the dataset's end."""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
from hypothesis import given, settings

from dlfleet.api.v1 import shards_pb2
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.shards import Answer, RoundConsumer, ShardBook, ShardSettings
from dlfleet.master.service.wire import snapshot_to_wire
from dlfleet.worker.loader.ledger import LeaseLedger
from dlfleet.worker.loader.snapshot import local_snapshot, merged

NAME = "ds"
ROUND = 1

ops = st.lists(
    st.one_of(
        st.tuples(st.just("lease"), st.integers(1, 3)),
        st.tuples(st.just("train"), st.integers(1, 9)),
        st.tuples(st.just("ack"), st.just(0)),
        st.tuples(st.just("snapshot"), st.just(0)),
        st.tuples(st.just("check"), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


class SyncRank:
    """One rank of a sync round, as the fetcher and stream drive the master."""

    def __init__(self, book: ShardBook, config: DatasetConfig) -> None:
        self.book = book
        self.config = config
        self.ledger = LeaseLedger()
        self.position = 0
        self.now = 0
        self.queue: deque[list[int]] = deque()  # [lease id, left to train], in order
        self.after_epoch = False
        self.ended = False
        self.base: tuple[shards_pb2.DatasetSnapshot, int] | None = None

    def ask(self) -> None:
        """One lease request at the next position, carrying the ready acks."""
        if self.ended or (self.after_epoch and not self.ledger.all_complete()):
            return
        done = self.ledger.take_ready()
        outcome, _ = self.book.lease(NAME, RoundConsumer(ROUND, self.position), self.now, "", done)
        self.ledger.confirm(done)
        if outcome.answer is Answer.WAIT:
            return
        self.position += 1
        self.after_epoch = outcome.answer is Answer.END_OF_EPOCH
        self.ended = outcome.answer is Answer.END_OF_DATASET
        if outcome.answer is Answer.SHARD:
            shard = outcome.shard
            assert shard is not None
            self.ledger.add(shard.lease_id, shard.end - shard.start, shard.epoch, shard.start)
            self.queue.append([shard.lease_id, shard.end - shard.start])

    def train(self, records: int) -> None:
        """Completed steps: a prefix of the queued leases, in order."""
        counts: list[tuple[int, int]] = []
        while records and self.queue:
            head = self.queue[0]
            take = min(records, head[1])
            head[1] -= take
            records -= take
            counts.append((head[0], take))
            if head[1] == 0:
                self.queue.popleft()
        if counts:
            self.ledger.consume(_Batch(counts))  # type: ignore[arg-type]

    def ack(self) -> None:
        done = self.ledger.take_ready()
        if done:
            # An ack rides on a lease request; this one asks for the last
            # position again (answered again, as a retried request is), so it
            # only carries the acks.
            last = RoundConsumer(ROUND, self.position - 1)
            self.book.lease(NAME, last, self.now, "", done)
            self.ledger.confirm(done)

    def master_snapshot(self) -> shards_pb2.DatasetSnapshot:
        snap, _ = self.book.snapshot(NAME, ROUND, self.ledger.progress(), self.now)
        return snapshot_to_wire(snap)

    def snapshot(self) -> None:
        mark = self.ledger.ack_mark()
        snap = self.master_snapshot()
        self.base = (snap, mark)
        self.ledger.forget_acked(mark)

    def computed(self) -> shards_pb2.DatasetSnapshot | None:
        if self.base is None:
            return None
        base, mark = self.base
        return local_snapshot(
            base,
            self.ledger.trained_since(mark),
            epoch_length=self.config.epoch_length,
            epochs=self.config.epochs,
        )


class _Batch:
    """Stands in for a GlobalBatch: the ledger reads only its lease counts."""

    def __init__(self, counts: list[tuple[int, int]]) -> None:
        self._counts = counts

    def lease_counts(self) -> list[tuple[int, int]]:
        return self._counts


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 60),
    batch=st.integers(1, 6),
    shard=st.integers(1, 16),
    epochs=st.integers(1, 3),
    drop_last=st.booleans(),
    operations=ops,
)
def test_the_loaders_own_snapshot_is_the_one_the_master_gives(
    size: int,
    batch: int,
    shard: int,
    epochs: int,
    drop_last: bool,
    operations: list[tuple[str, int]],
) -> None:
    config = DatasetConfig.create(
        name=NAME,
        size=size,
        batch_size=min(batch, size),
        shard_size=shard,
        epochs=epochs,
        seed=3,
        drop_last=drop_last,
    )
    book = ShardBook(ShardSettings(lease_timeout_ms=10**9, wait_retry_ms=5))
    book.register(config)
    rank = SyncRank(book, config)
    rank.snapshot()
    for op, n in operations:
        if op == "lease":
            for _ in range(n):
                rank.ask()
        elif op == "train":
            rank.train(n)
        elif op == "ack":
            rank.ack()
        elif op == "snapshot":
            rank.snapshot()
        else:
            assert rank.computed() == rank.master_snapshot()
    assert rank.computed() == rank.master_snapshot()


def test_failed_ranges_count_toward_the_epochs_end() -> None:
    base = shards_pb2.DatasetSnapshot(
        dataset="d",
        spec_digest="x",
        epoch=0,
        done=[shards_pb2.Range(start=0, end=4)],
        failed=[shards_pb2.FailedShard(epoch=0, range=shards_pb2.Range(start=4, end=8))],
    )
    out = local_snapshot(base, [(0, 8, 10)], epoch_length=10, epochs=2)
    assert (out.epoch, list(out.done), out.finished) == (1, [], False)
    assert list(out.failed) == list(base.failed)
    last = local_snapshot(base, [(0, 8, 10)], epoch_length=10, epochs=1)
    assert (last.epoch, list(last.done), last.finished) == (1, [], True)


def test_merged_ranges_are_disjoint_and_cover_the_same_positions() -> None:
    assert merged([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
