"""Alembic's entry point for the brain's migrations.

`dlfleet.brain.schema` passes an open connection in
`config.attributes["connection"]`; offline mode (SQL scripts for a DBA) uses
the `sqlalchemy.url` option instead.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from dlfleet.brain.models import Base
from dlfleet.brain.schema import VERSION_TABLE

config = context.config


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    connection = config.attributes.get("connection")
    if not isinstance(connection, Connection):
        raise RuntimeError("run the brain's migrations through dlfleet.brain.schema")
    run_online(connection)
