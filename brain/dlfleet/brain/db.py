"""Engines for the brain's database: a SQLite file (the default), PostgreSQL
(`postgresql+psycopg://`) or MySQL/MariaDB (`mysql+pymysql://`).

Bad URLs and missing drivers are InvalidArgument naming what to fix; no
message shows a password.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from dlfleet.api.errors import InvalidArgument

CONNECT_TIMEOUT_S = 10
SQLITE_BUSY_TIMEOUT_MS = 10_000
# backend -> the extra that installs its driver
_EXTRAS = {"postgresql": "postgres", "mysql": "mysql", "mariadb": "mysql"}


def parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InvalidArgument(f"bad database URL {url!r}: {exc}") from None
    if parsed.get_backend_name() not in ("sqlite", *_EXTRAS):
        raise InvalidArgument(
            f"unsupported database {safe_url(parsed)}: use sqlite:///FILE, "
            "postgresql+psycopg://... or mysql+pymysql://..."
        )
    return parsed


def safe_url(url: URL | str) -> str:
    parsed = url if isinstance(url, URL) else make_url(url)
    return parsed.render_as_string(hide_password=True)


def create(url: str) -> Engine:
    """An engine for `url`; it connects lazily."""
    parsed = parse_url(url)
    backend = parsed.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "sqlite":
        connect_args: dict[str, Any] = {"check_same_thread": False}
        if parsed.database in (None, "", ":memory:"):
            # One shared connection, or every thread would see its own empty database.
            kwargs["poolclass"] = StaticPool
        kwargs["connect_args"] = connect_args
    elif backend == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
        kwargs["pool_pre_ping"] = True
    else:
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S, "charset": "utf8mb4"}
        kwargs["pool_pre_ping"] = True
        kwargs["pool_recycle"] = 3600  # MySQL closes idle connections after 8 h
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ModuleNotFoundError) as exc:
        extra = _EXTRAS.get(backend, backend)
        raise InvalidArgument(
            f"no driver for {safe_url(parsed)} ({exc}): pip install 'dlfleet[{extra}]'"
        ) from None
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def describe(exc: SQLAlchemyError) -> str:
    """The database's own message, first line, without SQLAlchemy's wrapping."""
    cause: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"
