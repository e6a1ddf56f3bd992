"""The `StateStore` contract, run against every backend on a real database.

Each case gets its own random table prefix and drops its tables afterwards, so
cases never see each other's rows. PostgreSQL is the server on 127.0.0.1:5432
(override with DLFLEET_TEST_POSTGRES_URL); when it is unreachable its cases
fail under CI=true and are skipped otherwise.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
from harness import missing
from sqlalchemy import create_engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from dlfleet.master.store.base import (
    Checkpoint,
    JournalEntry,
    StateStore,
    StoreError,
    StreamState,
)
from dlfleet.master.store.sql import COMPACT_CHUNK_ROWS, INSERT_CHUNK_ROWS, open_store

pytestmark = pytest.mark.integration

POSTGRES_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)


@functools.cache
def _postgres_url() -> tuple[str | None, str]:
    """The first PostgreSQL URL that accepts a connection, or None and why not."""
    override = os.environ.get("DLFLEET_TEST_POSTGRES_URL")
    reasons = []
    for url in (override,) if override else POSTGRES_URLS:
        engine = create_engine(url, connect_args={"connect_timeout": 5})
        try:
            with engine.connect():
                return url, ""
        except SQLAlchemyError as exc:
            shown = make_url(url).render_as_string(hide_password=True)
            reasons.append(f"{shown}: {' '.join(str(getattr(exc, 'orig', exc)).split())}")
        finally:
            engine.dispose()
    return None, "; ".join(reasons)


def _require_postgres() -> str:
    url, reason = _postgres_url()
    if url is not None:
        return url
    missing(f"PostgreSQL is unreachable ({reason})")


@dataclass
class Backend:
    """One isolated place to open stores: a URL plus a table prefix."""

    url: str
    table_prefix: str
    opened: list[StateStore] = field(default_factory=list)

    def open(self) -> StateStore:
        store = open_store(self.url, table_prefix=self.table_prefix)
        self.opened.append(store)
        return store

    def reopen(self, store: StateStore) -> StateStore:
        store.close()
        return self.open()


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    prefix = f"t{uuid.uuid4().hex[:12]}_"
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state' / 'master.db'}"
    else:
        url = _require_postgres()
    b = Backend(url, prefix)
    yield b
    for store in b.opened:
        store.close()
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for table in ("journal", "checkpoints"):
                conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{prefix}{table}"')
    finally:
        engine.dispose()


def _all_seqs(store: StateStore) -> list[int]:
    return sorted(e.seq for state in store.load().values() for e in state.entries)


def test_appended_entries_survive_a_reopen(backend: Backend) -> None:
    store = backend.open()
    first = store.append([("nodes", '{"join": 1}'), ("dataset/a", '{"lease": 1}')])
    second = store.append([("nodes", '{"join": 2}')])

    loaded = backend.reopen(store).load()

    assert set(loaded) == {"nodes", "dataset/a"}
    assert loaded["nodes"].checkpoint is None
    assert loaded["nodes"].entries == (
        JournalEntry(first - 1, "nodes", '{"join": 1}'),
        JournalEntry(second, "nodes", '{"join": 2}'),
    )
    assert loaded["dataset/a"].entries == (JournalEntry(first, "dataset/a", '{"lease": 1}'),)


def test_seq_strictly_increases_across_streams_and_reopens(backend: Backend) -> None:
    store = backend.open()
    lasts = [store.append([("a", "1"), ("b", "2"), ("a", "3")]), store.append([("c", "4")])]
    store = backend.reopen(store)
    lasts.append(store.append([("b", "5"), ("c", "6")]))

    seqs = _all_seqs(store)
    assert lasts == sorted(set(lasts))
    assert len(seqs) == 6 and seqs == sorted(set(seqs))
    assert seqs[-1] == lasts[-1]
    # One append's entries are numbered consecutively, in the order given.
    assert [e.seq for e in store.load()["a"].entries] == [lasts[0] - 2, lasts[0]]


def test_seq_keeps_increasing_after_compaction_and_reopen(backend: Backend) -> None:
    store = backend.open()
    last = store.append([("a", "1"), ("a", "2"), ("a", "3")])
    store.checkpoint("a", "state@3", last)
    assert store.load()["a"].entries == ()

    store = backend.reopen(store)
    after = store.append([("a", "4")])

    assert after > last
    assert store.load()["a"].entries == (JournalEntry(after, "a", "4"),)


def test_checkpoint_drops_only_its_streams_entries_up_to_seq(backend: Backend) -> None:
    store = backend.open()
    store.append([("a", "a1"), ("b", "b1"), ("a", "a2")])
    upto = store.append([("b", "b2"), ("a", "a3")]) - 1  # the seq of b2
    kept = store.append([("a", "a4"), ("b", "b3")])

    store.checkpoint("a", "A@b2", upto)
    loaded = backend.reopen(store).load()

    assert loaded["a"].checkpoint == Checkpoint("a", upto, "A@b2")
    assert [e.payload for e in loaded["a"].entries] == ["a3", "a4"]
    assert loaded["b"].checkpoint is None
    assert [e.payload for e in loaded["b"].entries] == ["b1", "b2", "b3"]
    assert loaded["b"].entries[-1].seq == kept


def _journal_rows(backend: Backend) -> int:
    engine = create_engine(backend.url)
    try:
        with engine.connect() as conn:
            table = f'"{backend.table_prefix}journal"'
            return int(conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one())
    finally:
        engine.dispose()


def test_compaction_deletes_covered_rows_in_bounded_pieces_and_load_never_shows_them(
    backend: Backend,
) -> None:
    store = backend.open()
    half = COMPACT_CHUNK_ROWS // 2
    last = store.append([("a", str(i)) for i in range(2 * COMPACT_CHUNK_ROWS + half)])
    store.append([("b", "b1")])

    store.checkpoint("a", "A", last)
    assert _journal_rows(backend) == COMPACT_CHUNK_ROWS + half + 1  # one piece deleted
    assert store.load()["a"].entries == ()

    store.append([("a", "after1")])  # deletes the next piece
    assert _journal_rows(backend) == half + 2
    store.append([("a", "after2")])  # and the rest
    assert _journal_rows(backend) == 3
    assert [e.payload for e in store.load()["a"].entries] == ["after1", "after2"]
    assert [e.payload for e in store.load()["b"].entries] == ["b1"]


def test_rows_a_checkpoint_covers_are_deleted_after_a_reopen_too(backend: Backend) -> None:
    store = backend.open()
    last = store.append([("a", str(i)) for i in range(COMPACT_CHUNK_ROWS + 10)])
    store.checkpoint("a", "A", last)
    store = backend.reopen(store)
    assert _journal_rows(backend) == 10
    assert store.load()["a"].entries == ()

    after = store.append([("a", "after")])

    assert _journal_rows(backend) == 1
    assert store.load()["a"] == StreamState(
        Checkpoint("a", last, "A"), (JournalEntry(after, "a", "after"),)
    )


def test_newer_checkpoint_replaces_the_older_one(backend: Backend) -> None:
    store = backend.open()
    first = store.append([("a", "1")])
    store.checkpoint("a", "v1", first)
    second = store.append([("a", "2"), ("a", "3")])
    store.checkpoint("a", "v2", second - 1)

    state = store.load()["a"]
    assert state.checkpoint == Checkpoint("a", second - 1, "v2")
    assert state.entries == (JournalEntry(second, "a", "3"),)


def test_load_includes_streams_with_only_a_checkpoint_or_only_entries(backend: Backend) -> None:
    store = backend.open()
    last = store.append([("cp-only", "x"), ("entries-only", "y")])
    store.checkpoint("cp-only", "snapshot", last)

    loaded = store.load()

    assert loaded["cp-only"].checkpoint == Checkpoint("cp-only", last, "snapshot")
    assert loaded["cp-only"].entries == ()
    assert loaded["entries-only"].checkpoint is None
    assert [e.payload for e in loaded["entries-only"].entries] == ["y"]


def test_checkpoint_ahead_of_the_journal_or_going_back_is_rejected(backend: Backend) -> None:
    store = backend.open()
    last = store.append([("a", "1"), ("a", "2")])
    store.checkpoint("a", "v", last)

    with pytest.raises(StoreError, match="outside the journal"):
        store.checkpoint("a", "future", last + 1)
    with pytest.raises(StoreError, match="go back"):
        store.checkpoint("a", "older", last - 1)
    with pytest.raises(StoreError, match=r"stream_length|too long"):
        store.checkpoint("x" * 256, "v", last)
    assert store.load() == {"a": StreamState(Checkpoint("a", last, "v"))}


@pytest.mark.parametrize(
    "bad_entry",
    [
        pytest.param(("x" * 256, "payload"), id="stream-longer-than-255"),
        pytest.param(("", "payload"), id="empty-stream"),
        pytest.param(("a", cast(str, None)), id="null-payload"),
    ],
)
def test_failed_append_leaves_nothing_behind_and_seq_usable(
    backend: Backend, bad_entry: tuple[str, str]
) -> None:
    store = backend.open()
    before_last = store.append([("a", "kept")])
    before = store.load()

    with pytest.raises(StoreError, match="append of 4 entries failed") as caught:
        store.append([("a", "1"), ("b", "2"), bad_entry, ("a", "3")])
    assert caught.value.__cause__ is not None

    assert store.load() == before
    after = store.append([("a", "next")])
    assert after > before_last
    assert [e.payload for e in backend.reopen(store).load()["a"].entries] == ["kept", "next"]


def test_empty_append_returns_the_last_seq_and_writes_nothing(backend: Backend) -> None:
    store = backend.open()
    assert store.append([]) == 0
    last = store.append([("a", "1")])
    assert store.append([]) == last
    assert backend.reopen(store).append([]) == last


def test_append_of_several_insert_statements_is_one_consecutive_run(backend: Backend) -> None:
    store = backend.open()
    count = 2 * INSERT_CHUNK_ROWS + 500
    entries = [(f"dataset/d{i % 7}", f'{{"i": {i}, "pad": "{"x" * 200}"}}') for i in range(count)]
    last = store.append(entries)

    loaded = backend.reopen(store).load()

    by_seq = {e.seq: (e.stream, e.payload) for s in loaded.values() for e in s.entries}
    assert sorted(by_seq) == list(range(last - count + 1, last + 1))
    assert [by_seq[seq] for seq in sorted(by_seq)] == entries


def test_append_failing_in_its_last_insert_statement_writes_none_of_it(backend: Backend) -> None:
    store = backend.open()
    before = store.load()
    entries = [("a", str(i)) for i in range(INSERT_CHUNK_ROWS + 10)]
    entries.append(("", "empty stream name"))

    with pytest.raises(StoreError, match=f"append of {len(entries)} entries failed"):
        store.append(entries)

    assert store.load() == before
    assert backend.reopen(store).load() == before


def test_closed_store_refuses_calls_and_close_is_idempotent(backend: Backend) -> None:
    store = backend.open()
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.append([("a", "1")])
    with pytest.raises(StoreError, match="closed"):
        store.load()


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("not a url", "not a url"),
        ("mysql://app:s3cret@db/jobs", "mysql://app:***@db/jobs"),
        ("postgresql+asyncpg://app:s3cret@db/jobs", "postgresql+asyncpg://app:***@db/jobs"),
        ("sqlite://", "sqlite://"),
        ("sqlite:///:memory:", "in-memory"),
        ("postgresql+psycopg://app:s3cret@db:notaport/jobs", "postgresql+psycopg://app:***@db"),
    ],
)
def test_bad_url_is_a_store_error_naming_it_without_the_password(url: str, named: str) -> None:
    with pytest.raises(StoreError) as caught:
        open_store(url)
    assert named in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_unreachable_postgres_is_a_store_error_without_the_password() -> None:
    with pytest.raises(StoreError, match=r"postgresql\+psycopg://app:\*\*\*@127.0.0.1:1/jobs"):
        open_store("postgresql+psycopg://app:s3cret@127.0.0.1:1/jobs")


def test_bad_table_prefix_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="table prefix"):
        open_store(f"sqlite:///{tmp_path / 'x.db'}", table_prefix="x; DROP TABLE y")


def test_sqlite_store_creates_its_directory_and_runs_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "master.db"
    store = open_store(f"sqlite:///{path}")
    try:
        store.append([("a", "1")])
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()
