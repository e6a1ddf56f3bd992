"""The brain's databases for tests: a SQLite file, a fresh schema in the
PostgreSQL on 127.0.0.1:5432, a fresh database in the MariaDB on
127.0.0.1:3306. Each test run creates its own schema/database (named
`brain_test_<random>`) and drops it at the end, so runs sharing a server never
see each other; within a run, each test starts from empty tables.

PostgreSQL is required in CI (like the master's store tests); MariaDB is
skipped where unreachable, except in CI ($CI set) or with
$DLFLEET_TEST_REQUIRE_MARIADB=1.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from harness import POSTGRES_URL, require_postgres
from sqlalchemy import delete

from dlfleet.brain import db
from dlfleet.brain.models import Base
from dlfleet.brain.repository import Repository

MARIADB_URL = os.environ.get("DLFLEET_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), "mariadb"]


def require_mariadb() -> None:
    import pymysql

    url = db.parse_url(MARIADB_URL)
    try:
        pymysql.connect(
            host=url.host,
            port=url.port or 3306,
            user=url.username,
            password=url.password or "",
            connect_timeout=3,
        ).close()
    except pymysql.Error as exc:
        if os.environ.get("DLFLEET_TEST_REQUIRE_MARIADB") == "1" or os.environ.get("CI"):
            pytest.fail(f"MariaDB is required and unreachable at {MARIADB_URL}: {exc}")
        pytest.skip(f"MariaDB unreachable at {MARIADB_URL}")


@contextmanager
def _postgres_schema() -> Iterator[str]:
    require_postgres()
    import psycopg

    schema = "brain_test_" + secrets.token_hex(6)
    base = POSTGRES_URL.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in POSTGRES_URL else "?"
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextmanager
def _mariadb_database() -> Iterator[str]:
    require_mariadb()
    import pymysql

    name = "brain_test_" + secrets.token_hex(6)
    url = db.parse_url(MARIADB_URL)
    conn = pymysql.connect(
        host=url.host,
        port=url.port or 3306,
        user=url.username,
        password=url.password or "",
        autocommit=True,
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with conn.cursor() as cursor:
                cursor.execute(f"DROP DATABASE {name}")
    finally:
        conn.close()


def fresh_database(backend: str, tmp_path: Path) -> AbstractContextManager[str]:
    """An empty database of `backend`, dropped on exit."""
    if backend == "postgres":
        return _postgres_schema()
    if backend == "mariadb":
        return _mariadb_database()

    @contextmanager
    def sqlite() -> Iterator[str]:
        yield f"sqlite:///{tmp_path / ('brain-' + secrets.token_hex(4) + '.db')}"

    return sqlite()


@pytest.fixture(scope="session", params=BACKENDS)
def migrated_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One database per backend for the whole run, migrated to head."""
    with fresh_database(request.param, tmp_path_factory.mktemp("brain")) as url:
        Repository.open(url).close()
        yield url


def _empty_tables(repository: Repository) -> None:
    with repository.engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(delete(table))


@pytest.fixture
def brain_db_url(migrated_db_url: str) -> Iterator[str]:
    """The backend's database with empty tables."""
    repository = Repository.open(migrated_db_url, migrate=False)
    try:
        _empty_tables(repository)
        yield migrated_db_url
    finally:
        repository.close()


@pytest.fixture
def repository(brain_db_url: str) -> Iterator[Repository]:
    repo = Repository.open(brain_db_url)
    yield repo
    repo.close()


@pytest.fixture(params=BACKENDS)
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of each backend with nothing in it (not even the schema)."""
    with fresh_database(request.param, tmp_path) as url:
        yield url
