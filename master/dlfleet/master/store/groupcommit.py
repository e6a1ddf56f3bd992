"""Group commit: many small appends from many threads become one durable write.

A durable commit costs an fsync (SQLite) or a round trip plus a WAL flush
(PostgreSQL), whatever its size. The master's request handlers each need a
handful of events written before they answer, so `GroupCommitter` lets them
submit without blocking and has one writer thread append everything submitted
so far with a single `StateStore.append`.

Invariants:
- `submit` never blocks on I/O: it only takes a lock that the writer holds
  while it moves submissions in or out of the queue, never during a write.
  So it is safe on an asyncio event loop thread (wrap the result with
  `asyncio.wrap_future`).
- One submission is never split: its entries land in one append, all or none.
  A batch takes whole submissions in order until it would exceed `max_batch`
  entries; a submission larger than `max_batch` is written alone.
- Futures resolve in submission order, each only once everything submitted
  before it is durable. A future's value is the seq of its submission's last
  entry; for an empty submission, the last seq durable before it.
- If an append fails, every future of that batch gets the exception and the
  writer goes on with the next batch.
- The store must number one append's entries consecutively (SqlStateStore
  does): the seq of a submission inside a batch is derived from that.
- A future cancelled before the writer takes it is dropped unwritten.
- `submit_detached` queues entries with no future (nobody waits for them: a
  later submission's future covers them, by the order above); a failed append
  of them is logged.
- `submit_to` queues entries whose outcome goes to a `CommitSink` instead of a
  future: once per batch, on the writer thread, each sink is told the outcome
  (the seq, or the append's exception) of each of its submissions in the
  batch, in submission order, after the batch's futures are resolved. It
  spares the future's locks on both sides, for the master's hottest path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from dlfleet.master.store.base import StateStore, StoreError

_log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 4096


class CommitSink(Protocol):
    def committed(self, outcomes: list[tuple[object, int | BaseException]]) -> None:
        """Called on the writer thread once per batch: (token, seq of the
        submission's last entry, or the append's exception) for each of this
        sink's submissions in the batch, in submission order."""


@dataclass(frozen=True, slots=True)
class _Submission:
    entries: tuple[tuple[str, str], ...]
    future: Future[int] | None
    sink: CommitSink | None = None
    token: object = None


class GroupCommitter:
    """Batches `submit`ted entries into single appends on one writer thread."""

    def __init__(
        self,
        store: StateStore,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        thread_name: str = "dlfleet-group-commit",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._store = store
        self._max_batch = max_batch
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[_Submission] = deque()
        self._closing = False
        self._batches = 0
        self._entries = 0
        self._submissions = 0
        # Told (seconds, entries) after each durable append, on the writer thread.
        self.on_commit: Callable[[float, int], None] | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def batches(self) -> int:
        """Appends made so far (failed ones included)."""
        return self._batches

    @property
    def entries(self) -> int:
        """Entries written so far (those of failed appends excluded)."""
        return self._entries

    @property
    def submissions(self) -> int:
        """Submissions accepted so far."""
        return self._submissions

    def submit(self, entries: Sequence[tuple[str, str]]) -> Future[int]:
        """Queue (stream, payload) pairs to be appended together; the future
        gives the seq of the last one once they are durable."""
        future: Future[int] = Future()
        self._queue(_Submission(tuple(entries), future))
        return future

    def submit_detached(self, entries: Sequence[tuple[str, str]]) -> None:
        """`submit` without a future, for entries nobody waits for: what
        follows them waits for them too. Spares the future (a lock and a
        condition) per submission."""
        self._queue(_Submission(tuple(entries), None))

    def submit_to(
        self, entries: Sequence[tuple[str, str]], sink: CommitSink, token: object
    ) -> None:
        """`submit`, with the outcome told to `sink` with `token` (see the
        module docstring) instead of a future's."""
        self._queue(_Submission(tuple(entries), None, sink, token))

    def _queue(self, submission: _Submission) -> None:
        with self._cond:
            if self._closing:
                raise StoreError("the group committer is closed")
            self._pending.append(submission)
            self._submissions += 1
            self._cond.notify()

    def close(self) -> None:
        """Write everything submitted so far, then stop the writer. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        # A done-callback runs on the writer thread and may call close().
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if batch:  # empty when every taken future had been cancelled
                self._write(batch)

    def _take_batch(self) -> list[_Submission] | None:
        """Wait for submissions and take the next batch; None once closed and
        drained."""
        with self._cond:
            while not self._pending and not self._closing:
                self._cond.wait()
            batch: list[_Submission] = []
            size = 0
            while self._pending:
                nxt = self._pending[0]
                if batch and size + len(nxt.entries) > self._max_batch:
                    break
                self._pending.popleft()
                if nxt.future is None or nxt.future.set_running_or_notify_cancel():
                    batch.append(nxt)
                    size += len(nxt.entries)
            if not batch and self._closing and not self._pending:
                return None
            return batch

    def _write(self, batch: list[_Submission]) -> None:
        entries = [entry for submission in batch for entry in submission.entries]
        start = time.perf_counter()
        told: _Told = {}
        try:
            last = self._store.append(entries)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting future
            self._batches += 1
            _log.warning("group commit of %d entries failed: %s", len(entries), exc)
            for submission in batch:
                if submission.future is not None:
                    submission.future.set_exception(exc)
                elif submission.sink is not None:
                    _note(told, submission, exc)
            _tell(told)
            return
        self._batches += 1
        self._entries += len(entries)
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - start, len(entries))
        # Consecutive numbering: the batch took seqs last-len+1 .. last.
        seq = last - len(entries)
        for submission in batch:
            seq += len(submission.entries)
            if submission.future is not None:
                submission.future.set_result(seq)
            elif submission.sink is not None:
                _note(told, submission, seq)
        _tell(told)


# Per sink (by identity): the sink and its submissions' outcomes in a batch.
_Told = dict[int, tuple[CommitSink, list[tuple[object, int | BaseException]]]]


def _note(told: _Told, submission: _Submission, outcome: int | BaseException) -> None:
    sink = submission.sink
    assert sink is not None
    entry = told.get(id(sink))
    if entry is None:
        entry = told[id(sink)] = (sink, [])
    entry[1].append((submission.token, outcome))


def _tell(told: _Told) -> None:
    for sink, outcomes in told.values():
        try:
            sink.committed(outcomes)
        except Exception:  # noqa: BLE001 - one sink failing must not stop the writer
            _log.exception("a commit sink failed")
