"""GroupCommitter over a real SQLite store: grouping, ordering, failure
isolation and flush on close. The backends themselves are covered by the store
contract suite; the committer does not depend on which one it drives."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest

from dlfleet.master.store.base import StateStore, StoreError, StreamState
from dlfleet.master.store.groupcommit import GroupCommitter
from dlfleet.master.store.sql import open_store

pytestmark = pytest.mark.integration


class GatedStore(StateStore):
    """A real store whose first append waits for `release`, so that a test can
    pile submissions up behind it and know exactly what the next batch holds."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def append(self, entries: Sequence[tuple[str, str]]) -> int:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never opened the gate"
        return self.inner.append(entries)

    def load(self) -> dict[str, StreamState]:
        return self.inner.load()

    def checkpoint(self, stream: str, payload: str, upto_seq: int) -> None:
        self.inner.checkpoint(stream, payload, upto_seq)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'master.db'}"


@pytest.fixture
def store(url: str) -> Iterator[StateStore]:
    s = open_store(url)
    yield s
    s.close()


def _payloads(store: StateStore) -> dict[str, list[str]]:
    return {name: [e.payload for e in s.entries] for name, s in store.load().items()}


def test_concurrent_submissions_are_all_durable_and_grouped(url: str, store: StateStore) -> None:
    committer = GroupCommitter(store)
    threads, per_thread = 16, 200
    start = threading.Barrier(threads)
    results: dict[int, list[int]] = {}

    def submitter(t: int) -> None:
        start.wait()
        futures = [committer.submit([(f"node/{t}", f'{{"n": {i}}}')]) for i in range(per_thread)]
        results[t] = [f.result(timeout=60) for f in futures]

    workers = [threading.Thread(target=submitter, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    committer.close()
    store.close()

    assert committer.submissions == committer.entries == threads * per_thread
    assert committer.batches < threads * per_thread
    for seqs in results.values():
        assert seqs == sorted(set(seqs))  # one thread's submissions keep their order
    reopened = open_store(url)
    try:
        loaded = reopened.load()
    finally:
        reopened.close()
    assert {name: len(s.entries) for name, s in loaded.items()} == {
        f"node/{t}": per_thread for t in range(threads)
    }
    durable = {e.seq: e for s in loaded.values() for e in s.entries}
    for t, seqs in results.items():
        assert [durable[seq].payload for seq in seqs] == [
            f'{{"n": {i}}}' for i in range(per_thread)
        ]
        assert {durable[seq].stream for seq in seqs} == {f"node/{t}"}


def test_futures_resolve_in_order_each_after_everything_before_it_is_durable(
    url: str, store: StateStore
) -> None:
    committer = GroupCommitter(store, max_batch=7)
    reader = open_store(url)  # a second connection sees only committed rows
    resolved: list[int] = []
    not_yet_durable: list[int] = []
    sizes = [i % 4 for i in range(60)]  # includes empty submissions

    def on_done(future: Future[int]) -> None:
        index = futures.index(future)
        resolved.append(index)
        if index % 10 == 0:
            durable = max((e.seq for s in reader.load().values() for e in s.entries), default=0)
            if durable < future.result():
                not_yet_durable.append(index)

    futures: list[Future[int]] = []
    for index, size in enumerate(sizes):
        future = committer.submit([("s", f"{index}.{k}") for k in range(size)])
        futures.append(future)  # before the callback, which may run at once
        future.add_done_callback(on_done)
    committer.close()
    reader.close()

    assert resolved == list(range(len(sizes)))
    assert not_yet_durable == []
    seqs = [f.result() for f in futures]
    for index in range(1, len(sizes)):
        # An empty submission reports the last seq durable before it.
        assert seqs[index] == seqs[index - 1] + sizes[index]
    assert committer.batches < len(sizes)


def test_detached_submissions_are_written_in_order_and_covered_by_the_next_future(
    url: str, store: StateStore
) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated, max_batch=3)
    first = committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    for index in range(5):  # queued behind the gate, over several batches
        committer.submit_detached([("s", f"join {index}")])
    after = committer.submit([("s", "formed")])
    gated.release.set()
    seq = after.result(timeout=10)
    # Everything before it is durable once its future resolves.
    reader = open_store(url)
    assert _payloads(reader) == {"s": ["first", *(f"join {i}" for i in range(5)), "formed"]}
    assert seq == first.result() + 6
    reader.close()
    committer.close()
    with pytest.raises(StoreError, match="closed"):
        committer.submit_detached([("s", "too late")])


def test_a_failed_detached_submission_is_logged_and_fails_its_batch(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    """What waits behind a detached entry learns that it failed."""
    gated = GatedStore(store)
    committer = GroupCommitter(gated)
    first = committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    committer.submit_detached([("x" * 256, "stream name too long")])
    behind = committer.submit([("s", "same batch")])
    gated.release.set()
    assert first.result(timeout=10) > 0
    with pytest.raises(StoreError, match="stream_length"):
        behind.result(timeout=10)
    assert committer.submit([("s", "later")]).result(timeout=10) > 0
    committer.close()
    assert "group commit of 2 entries failed" in caplog.text
    assert _payloads(store) == {"s": ["first", "later"]}


def test_failed_batch_fails_only_its_own_futures(store: StateStore) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated)
    first = committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    doomed = [
        committer.submit([("s", "same batch, before")]),
        committer.submit([("x" * 256, "stream name too long")]),
        committer.submit([("s", "same batch, after")]),
    ]
    gated.release.set()

    first_seq = first.result(timeout=10)
    for future in doomed:
        with pytest.raises(StoreError, match="stream_length"):
            future.result(timeout=10)
    later_seq = committer.submit([("s", "later")]).result(timeout=10)
    committer.close()

    assert later_seq > first_seq
    assert committer.batches == 3
    assert _payloads(store) == {"s": ["first", "later"]}


def test_close_flushes_pending_submissions_then_refuses_more(url: str, store: StateStore) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated)
    committer.submit([("s", "in flight")])
    assert gated.entered.wait(10)
    pending = [committer.submit([("s", f"pending {i}")]) for i in range(5)]

    opener = threading.Timer(0.2, gated.release.set)
    opener.start()
    committer.close()  # called while the writer is stuck behind the gate
    opener.join()

    assert all(f.done() for f in pending)
    assert [f.result() for f in pending] == sorted({f.result() for f in pending})
    with pytest.raises(StoreError, match="closed"):
        committer.submit([("s", "too late")])
    committer.close()
    assert _payloads(store) == {"s": ["in flight"] + [f"pending {i}" for i in range(5)]}


def test_submission_larger_than_max_batch_is_written_whole_and_alone(store: StateStore) -> None:
    committer = GroupCommitter(store, max_batch=10)
    small = committer.submit([("s", "small")])
    big = committer.submit([("s", str(i)) for i in range(25)])
    after = committer.submit([("s", "after")])
    committer.close()

    assert big.result() == small.result() + 25
    assert after.result() == big.result() + 1
    assert len(_payloads(store)["s"]) == 27


def test_future_cancelled_before_the_writer_takes_it_is_not_written(store: StateStore) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated)
    committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    assert committer.submit([("s", "cancelled")]).cancel()
    kept = committer.submit([("s", "kept")])
    gated.release.set()
    committer.close()

    assert kept.result() > 0
    assert _payloads(store) == {"s": ["first", "kept"]}


def test_submit_works_from_an_asyncio_event_loop(store: StateStore) -> None:
    committer = GroupCommitter(store)

    async def handler(i: int) -> int:
        return await asyncio.wrap_future(committer.submit([("s", str(i))]))

    async def main() -> list[int]:
        return await asyncio.gather(*(handler(i) for i in range(50)))

    seqs = asyncio.run(main())
    committer.close()

    assert sorted(seqs) == sorted(set(seqs)) and len(seqs) == 50
    assert len(_payloads(store)["s"]) == 50


class RecordingSink:
    """A `CommitSink` that records what it is told, and on which thread."""

    def __init__(self) -> None:
        self.told: list[list[tuple[object, int | BaseException]]] = []
        self.threads: set[str] = set()
        self.done = threading.Event()

    def committed(self, outcomes: list[tuple[object, int | BaseException]]) -> None:
        self.told.append(outcomes)
        self.threads.add(threading.current_thread().name)
        self.done.set()


def test_a_sink_is_told_once_per_batch_in_order_after_the_batch_is_durable(
    url: str, store: StateStore
) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated, thread_name="writer")
    first = committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    sink, other = RecordingSink(), RecordingSink()
    committer.submit_to([("s", "a1"), ("s", "a2")], sink, "a")
    committer.submit_to([("s", "b")], other, "b")
    middle = committer.submit([("s", "middle")])
    committer.submit_to([("s", "c")], sink, "c")
    gated.release.set()
    assert middle.result(timeout=10) > 0 and sink.done.wait(10) and other.done.wait(10)
    base = first.result()
    # One call per sink for the batch, its submissions in order, each with
    # the seq of its last entry.
    assert sink.told == [[("a", base + 2), ("c", base + 5)]]
    assert other.told == [[("b", base + 3)]]
    assert sink.threads == {"writer"}
    reader = open_store(url)
    assert _payloads(reader) == {"s": ["first", "a1", "a2", "b", "middle", "c"]}
    reader.close()
    committer.close()


def test_a_sink_is_told_the_exception_of_a_failed_batch(store: StateStore) -> None:
    gated = GatedStore(store)
    committer = GroupCommitter(gated)
    first = committer.submit([("s", "first")])
    assert gated.entered.wait(10)
    sink = RecordingSink()
    committer.submit_to([("s", "same batch")], sink, 1)
    committer.submit_to([("x" * 256, "stream name too long")], sink, 2)
    gated.release.set()
    assert first.result(timeout=10) > 0 and sink.done.wait(10)
    [outcomes] = sink.told
    assert [token for token, _ in outcomes] == [1, 2]
    for _, outcome in outcomes:
        assert isinstance(outcome, StoreError) and "stream_length" in str(outcome)
    committer.close()


def test_a_failing_sink_does_not_stop_the_writer(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def committed(self, outcomes: list[tuple[object, int | BaseException]]) -> None:
            raise RuntimeError("sink bug")

    committer = GroupCommitter(store)
    committer.submit_to([("s", "one")], Broken(), None)
    assert committer.submit([("s", "two")]).result(timeout=10) > 0
    committer.close()
    assert "a commit sink failed" in caplog.text
    assert _payloads(store) == {"s": ["one", "two"]}
