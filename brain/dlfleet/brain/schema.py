"""The brain's schema, migrated with Alembic from inside the package.

`migrate(url)` (and `Repository.open`) upgrade a database to the newest
revision: from empty, the tables are created; at head, nothing happens. A
database migrated by a newer brain (a revision this one does not know) is
refused with SchemaError rather than used half-understood. Alembic's version
table is `brain_alembic_version`, apart from anyone else's.

Alembic logs at INFO as it is imported (its plugins) and as it runs: a
dozen lines each time a job opens the brain. Unless DEBUG is on, it is kept to
warnings (so it is imported only inside `_alembic()`, never at the top of a
module), and a migration that actually runs says one line of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from dlfleet.brain import db
from dlfleet.brain.errors import DatabaseError, SchemaError

if TYPE_CHECKING:
    from alembic.config import Config

_log = logging.getLogger(__name__)

VERSION_TABLE = "brain_alembic_version"
MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(connection: Connection | None = None) -> Config:
    with _alembic():
        from alembic.config import Config
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head() -> str:
    with _alembic():
        from alembic.script import ScriptDirectory
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert revision is not None, "the brain ships at least one migration"
    return revision


def current(connection: Connection) -> str | None:
    with _alembic():  # configuring a context logs its dialect
        from alembic.runtime.migration import MigrationContext

        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    with _connection(engine, f"upgrade to {revision}") as conn:
        known = current(conn)
        if known is not None and not _knows(known):
            raise SchemaError(
                f"{db.safe_url(engine.url)} is at schema revision {known}, unknown to this "
                f"brain (newest known: {head()}): upgrade dlfleet"
            )
        with _alembic():
            from alembic import command

            command.upgrade(alembic_config(conn), revision)
        now = current(conn)
        if now != known:
            _log.info(
                "brain database %s: schema upgraded from %s to %s",
                db.safe_url(engine.url),
                known or "empty",
                now,
            )


def _knows(revision: str) -> bool:
    with _alembic():
        from alembic.script import ScriptDirectory
        from alembic.util import CommandError
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except CommandError:
        return False


def downgrade(engine: Engine, revision: str) -> None:
    with _connection(engine, f"downgrade to {revision}") as conn, _alembic():
        from alembic import command

        command.downgrade(alembic_config(conn), revision)


def migrate(url: str) -> str:
    """Upgrade the database at `url` to head; returns the revision."""
    engine = db.create(url)
    try:
        upgrade(engine)
        return head()
    finally:
        engine.dispose()


@contextmanager
def _alembic() -> Iterator[None]:
    """Alembic's loggers at WARNING for the block, unless DEBUG is on: import
    Alembic, or run it, in this block."""
    logger = logging.getLogger("alembic")
    before = logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


class _connection:
    """A connection whose work is committed on success; database errors
    become DatabaseError naming the URL (never its password)."""

    def __init__(self, engine: Engine, what: str) -> None:
        self._engine = engine
        self._what = what
        self._conn: Connection | None = None

    def __enter__(self) -> Connection:
        try:
            self._conn = self._engine.connect()
        except SQLAlchemyError as exc:
            raise DatabaseError(
                f"{self._what}: cannot connect to {db.safe_url(self._engine.url)}: "
                f"{db.describe(exc)}"
            ) from exc
        return self._conn

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        assert self._conn is not None
        try:
            if exc is None:
                self._conn.commit()
            else:
                self._conn.rollback()
        finally:
            self._conn.close()
        if isinstance(exc, SQLAlchemyError):
            raise DatabaseError(
                f"{self._what} of {db.safe_url(self._engine.url)} failed: {db.describe(exc)}"
            ) from exc
