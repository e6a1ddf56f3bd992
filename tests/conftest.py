"""Shared fixtures: real stores (a SQLite file, a fresh schema in the PostgreSQL
on 127.0.0.1:5432), real masters on 127.0.0.1:0.

hypothesis is imported here, at collection, on the main thread: CPython 3.11.7
can fail an import that pytest rewrites while other threads run
("AST constructor recursion depth mismatch", python/cpython#106905), and the
hypothesis plugin otherwise imports it lazily at the end of the run, when the
gRPC threads of the integration tests are still alive."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis  # noqa: F401 - imported before any test starts threads: see below
import pytest
from harness import (
    POSTGRES_URL,
    LoopThread,
    MasterProcess,
    Running,
    require_postgres,
    start_in_process,
    stop_in_process,
)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'master.db'}"
        return
    require_postgres()
    import psycopg

    schema = "t_" + secrets.token_hex(6)
    base = POSTGRES_URL.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in POSTGRES_URL else "?"
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def master_process() -> Iterator[Callable[..., MasterProcess]]:
    started: list[MasterProcess] = []

    def start(store: str, *extra: str, port: int = 0) -> MasterProcess:
        proc = MasterProcess(store, token="test-token", extra=extra, port=port).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def start_master(loop_thread: LoopThread, store_url: str) -> Iterator[Callable[..., Running]]:
    """start(settings=None, port=0, **options) -> Running: an in-process master
    on the test's store (`options` go to MasterServer); `start.stop(running)`
    stops one early. All stop at the end."""
    from dlfleet.master.service.state import MasterSettings

    running: list[Running] = []

    def start(settings: MasterSettings | None = None, port: int = 0, **options: Any) -> Running:
        r = start_in_process(
            loop_thread, store_url, settings or MasterSettings(job_name="job"), port, **options
        )
        running.append(r)
        return r

    start.stop = lambda r: stop_in_process(loop_thread, r)  # type: ignore[attr-defined]
    yield start
    for r in running:
        stop_in_process(loop_thread, r)
