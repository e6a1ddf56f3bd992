"""The loader's epoch state: where global batches come from, which of them the
training loop has finished, and how that becomes acks and checkpoints.

A stream hands out the global batches of the current epoch (`batches`), in
order, and remembers every batch handed to the DataLoader until the training
loop completes it (`issued`). The DataLoader prefetches, so "handed out" is not
"trained": a batch is *completed* only when the loop asks for the batch after
it (or calls `state_dict`, or starts a new iteration after a `break`), which
the user's loop does only after the step that consumed it finished.

Invariants:
- `issued` holds, in order, the batches handed to the DataLoader and not yet
  completed; completing always takes its head (DataLoader yields in order).
- An iteration abandoned mid-epoch is resumed: the batches the DataLoader had
  prefetched but the loop never received are handed out again, first.
- A batch cut but not yet handed out waits in `ready`, never in a generator's
  frame, so abandoning the DataLoader's iterator loses nothing.
- With a master, a lease is acked only when every record of it was in a
  completed batch (see ledger.py); a snapshot counts exactly the completed
  batches. Without one, the state is (epoch, batches completed).
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import InvalidArgument, Unavailable
from dlfleet.api.v1 import shards_pb2
from dlfleet.worker.loader.environment import LoaderEnvironment, LoaderMode
from dlfleet.worker.loader.fetcher import EndOfDataset, EndOfEpoch, LeasedShard, LeaseFetcher
from dlfleet.worker.loader.ledger import LeaseLedger
from dlfleet.worker.loader.slicing import BatchCutter, GlobalBatch, Segment
from dlfleet.worker.loader.snapshot import local_snapshot

_log = logging.getLogger(__name__)

ACK_FLUSH_TIMEOUT_S = 30.0
QUICK_SNAPSHOT_S = 0.5  # a snapshot not answered within this is computed here
# How long a sync-mode loader computes its snapshots itself from the master's
# last one before asking the master again: a save per step would otherwise
# wait for a round trip on every step.
SNAPSHOT_REFRESH_S = 1.0


class EpochStream(abc.ABC):
    """What both kinds of stream share: the issued batches and the loop's
    progress through them."""

    def __init__(self, global_batch: int, world_size: int) -> None:
        self.global_batch = global_batch
        self.world_size = world_size
        self.issued: deque[GlobalBatch] = deque()
        self.ready: deque[GlobalBatch] = deque()  # cut, not yet handed out
        self.user_pending = 0  # batches the loop received and has not finished
        self.epoch = 0
        self.epoch_ended = True  # the next iteration starts a new epoch
        self.dataset_ended = False

    def begin_iteration(self) -> None:
        self.complete_received()
        if self.epoch_over:
            self.epoch_ended = False
            self._next_epoch()

    @property
    def epoch_over(self) -> bool:
        """The epoch's last batch was handed out and trained."""
        return self.epoch_ended and not self.ready and not self.issued

    def batches(self) -> Iterator[GlobalBatch]:
        """The DataLoader's view: replay of what it lost, then new batches."""
        yield from list(self.issued)
        while True:
            if self.ready:
                batch = self.ready.popleft()
                self.issued.append(batch)
                yield batch
            elif self.epoch_ended:
                return
            else:
                self._fill()

    def received(self) -> None:
        self.user_pending += 1

    def complete_received(self) -> None:
        while self.user_pending:
            self.user_pending -= 1
            self._complete(self.issued.popleft())

    def end_iteration(self) -> None:
        """The loop asked past the last batch: all it received is trained."""
        self.complete_received()

    @abc.abstractmethod
    def _next_epoch(self) -> None:
        """Move to the next epoch."""

    @abc.abstractmethod
    def _fill(self) -> None:
        """Cut more batches into `ready`, or mark the epoch ended."""

    @abc.abstractmethod
    def _complete(self, batch: GlobalBatch) -> None:
        """`batch` was trained: record it."""


class LeasedStream(EpochStream):
    """Global batches cut from shards leased from the master, to the round
    (sync) or to this rank (async)."""

    def __init__(
        self,
        client: MasterClient,
        dataset: str,
        env: LoaderEnvironment,
        mode: LoaderMode,
        global_batch: int,
        world_size: int,
        *,
        epoch_length: int,
        epochs: int,
    ) -> None:
        super().__init__(global_batch, world_size)
        self.client = client
        self.dataset = dataset
        self.env = env
        self.mode = mode
        self.ledger = LeaseLedger()
        self.fetcher: LeaseFetcher | None = None
        self._cutter: BatchCutter | None = None
        self.epoch_length = epoch_length
        self.epochs = epochs
        # For the snapshots a save waits on: one short attempt, see snapshot().
        self._quick = client.sharing_channel(
            timeout_s=QUICK_SNAPSHOT_S, retry=RetryPolicy(attempts=1)
        )
        self._base: tuple[shards_pb2.DatasetSnapshot, int] | None = None  # the last, its mark
        self._base_until = 0.0  # monotonic time: the base is asked for again after it

    @property
    def started(self) -> bool:
        return self.fetcher is not None

    def start(self) -> None:
        if self.fetcher is None:
            self.fetcher = LeaseFetcher(self.client, self.ledger, self.dataset, self.env, self.mode)
            self.fetcher.start()

    def _next_epoch(self) -> None:
        self._cutter = None

    def _fill(self) -> None:
        assert self.fetcher is not None, "start() the stream before iterating"
        outcome = self.fetcher.next_outcome()
        if isinstance(outcome, LeasedShard):
            cutter = self._cutter
            if cutter is None or cutter.epoch != outcome.epoch:
                if cutter is not None and cutter.buffered:
                    raise RuntimeError(
                        f"dataset {self.dataset!r}: a shard of epoch {outcome.epoch} came "
                        f"before the end of epoch {cutter.epoch}"
                    )
                cutter = self._cutter = BatchCutter(
                    self.global_batch, self.world_size, outcome.epoch
                )
                self.epoch = outcome.epoch
            self.ready.extend(cutter.push(Segment(outcome.lease_id, outcome.start, outcome.end)))
        elif isinstance(outcome, EndOfEpoch):
            if self._cutter is not None:
                self.ready.extend(self._cutter.finish())
            self._cutter = None
            self.epoch_ended = True
        else:
            assert isinstance(outcome, EndOfDataset)
            self.dataset_ended = self.epoch_ended = True

    def _complete(self, batch: GlobalBatch) -> None:
        # The fetcher waits on the ledger only for a lease to become ready to
        # ack; waking it on every batch would cost a thread switch per step.
        if self.ledger.consume(batch) and self.fetcher is not None:
            self.fetcher.poke()

    def end_iteration(self) -> None:
        super().end_iteration()
        if self.epoch_over:
            # The last step of the epoch is done: wait until the master has its
            # acks, so a process that exits now leaves the epoch complete.
            if self.fetcher is not None:
                self.fetcher.poke()
            self.ledger.wait_acked(ACK_FLUSH_TIMEOUT_S)

    def snapshot(self) -> shards_pb2.DatasetSnapshot:
        """The master's snapshot as of the completed batches. In sync mode
        it is computed here from the last one the master gave and what was
        trained since (snapshot.py: in sync mode that is exactly what moves
        the master); the master is asked again once SNAPSHOT_REFRESH_S have
        passed (that save waits for the answer, the others in between do
        not), which also bounds what the ledger keeps. A master that does not
        answer at once then (it restarts) is not waited for: checkpoints go
        on without it."""
        self.complete_received()
        if self.mode is not LoaderMode.SYNC:
            return self.client.snapshot(self.dataset, progress=self.ledger.progress())
        if self._base is not None and time.monotonic() < self._base_until:
            return self._computed(self._base)
        mark = self.ledger.ack_mark()
        progress = self.ledger.progress()
        if self._base is not None:
            try:
                snap = self._quick.snapshot(self.dataset, round=self.env.round, progress=progress)
            except Unavailable as exc:
                _log.info(
                    "dataset %r: the master did not answer a snapshot (%s); computed it from "
                    "the last one and the leases trained since",
                    self.dataset,
                    exc,
                )
                return self._computed(self._base)
        else:  # the first: nothing to compute one from
            snap = self.client.snapshot(self.dataset, round=self.env.round, progress=progress)
        self._base = (snap, mark)
        self._base_until = time.monotonic() + SNAPSHOT_REFRESH_S
        self.ledger.forget_acked(mark)
        return snap

    def _computed(self, base: tuple[shards_pb2.DatasetSnapshot, int]) -> shards_pb2.DatasetSnapshot:
        """The snapshot from the master's last one and what was trained since."""
        snapshot, since = base
        return local_snapshot(
            snapshot,
            self.ledger.trained_since(since),
            epoch_length=self.epoch_length,
            epochs=self.epochs,
        )

    def forget_base(self) -> None:
        """The dataset was put back (a restore): the last snapshot is history."""
        self._base = None

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.stop()


class LocalStream(EpochStream):
    """No master: each epoch is one range of positions, sliced like a round's
    shards, so every rank yields the same number of batches and no record is
    repeated or dropped (except the cut a `drop_last` asks for)."""

    def __init__(self, epoch_length: int, epochs: int, global_batch: int, world_size: int) -> None:
        super().__init__(global_batch, world_size)
        self.epoch_length = epoch_length
        self.epochs = epochs
        self.epoch = -1
        self.completed = 0  # batches of `epoch` the loop finished
        self._skip = 0

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.completed, skip, self._skip = self._skip, self._skip, 0
        self.epoch_ended = True  # all of the epoch's batches are cut at once
        if self.epoch >= self.epochs:
            self.dataset_ended = True
            return
        cutter = BatchCutter(self.global_batch, self.world_size, self.epoch)
        batches = [*cutter.push(Segment(0, 0, self.epoch_length)), *cutter.finish()]
        if skip and skip >= len(batches):
            # Restored after the epoch's last batch: the next epoch follows at
            # once, as the master's leases do after such a restore.
            self._next_epoch()
            return
        self.ready.extend(batches[skip:])

    def _fill(self) -> None:
        raise AssertionError("a local epoch is cut whole when it starts")

    def _complete(self, batch: GlobalBatch) -> None:
        self.completed += 1

    def state(self) -> dict[str, Any]:
        self.complete_received()
        return {"epoch": max(self.epoch, 0), "batches": self.completed}

    def restore(self, state: dict[str, Any]) -> None:
        if self.epoch >= 0:
            raise InvalidArgument("load_state_dict must be called before iterating the loader")
        self.epoch = int(state["epoch"]) - 1
        self._skip = int(state["batches"])
