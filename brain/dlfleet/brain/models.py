"""The brain's tables (SQLAlchemy 2.0 declarative models).

Portable across SQLite, PostgreSQL and MySQL/MariaDB: strings have lengths
(MySQL indexes need them), bytes are BIGINT, floats DOUBLE, enums plain
strings (no native ENUM to migrate), times naive UTC with microseconds
(`UtcDateTime`; MySQL's DATETIME needs fsp=6 for that). Every table is named
`brain_*`, so the brain can share a database with the master's store.

The schema changes only through a migration in `migrations/versions`; a test
checks that the models and the migrations agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

NAME_LENGTH = 255
KIND_LENGTH = 16
RULE_LENGTH = 64

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT keys everywhere but SQLite, where only INTEGER PRIMARY KEY autoincrements.
Id = BigInteger().with_variant(Integer(), "sqlite")


def datetime_type() -> TypeEngine[datetime]:
    """The column type behind UtcDateTime (also what the migrations create)."""
    return DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out; stored naive UTC."""

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(datetime_type())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("UtcDateTime needs an aware datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobRow(Base):
    __tablename__ = "brain_jobs"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    signature: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(KIND_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


def _job_fk() -> Mapped[int]:
    return mapped_column(BigInteger, ForeignKey("brain_jobs.id", ondelete="CASCADE"))


class RoundRow(Base):
    __tablename__ = "brain_rounds"
    __table_args__ = (UniqueConstraint("job_id", "round"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = _job_fk()
    round: Mapped[int] = mapped_column(BigInteger)
    nodes: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ended_at: Mapped[datetime] = mapped_column(UtcDateTime)
    samples_per_s: Mapped[float] = mapped_column(Double)
    step_time_mean_s: Mapped[float] = mapped_column(Double)
    step_time_p50_s: Mapped[float] = mapped_column(Double)
    step_time_p90_s: Mapped[float] = mapped_column(Double)


class NodeSampleRow(Base):
    __tablename__ = "brain_node_samples"
    __table_args__ = (Index(None, "job_id", "at"), Index(None, "job_id", "node"))

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = _job_fk()
    node: Mapped[str] = mapped_column(String(NAME_LENGTH))
    round: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(UtcDateTime)
    cpu_percent: Mapped[float] = mapped_column(Double)
    memory_rss_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_limit_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_request_bytes: Mapped[int] = mapped_column(BigInteger)
    samples_per_s: Mapped[float] = mapped_column(Double)
    step_time_s: Mapped[float] = mapped_column(Double)


class FailureRow(Base):
    __tablename__ = "brain_failures"
    __table_args__ = (Index(None, "job_id", "at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = _job_fk()
    node: Mapped[str] = mapped_column(String(NAME_LENGTH))
    kind: Mapped[str] = mapped_column(String(KIND_LENGTH))
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(UtcDateTime)


class NodeCheckRow(Base):
    __tablename__ = "brain_node_checks"
    __table_args__ = (Index(None, "job_id", "at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = _job_fk()
    node: Mapped[str] = mapped_column(String(NAME_LENGTH))
    at: Mapped[datetime] = mapped_column(UtcDateTime)
    faulty: Mapped[bool] = mapped_column(Boolean)
    rule: Mapped[str] = mapped_column(String(RULE_LENGTH))
    compute_ms: Mapped[float] = mapped_column(Double)
    compute_reference_ms: Mapped[float] = mapped_column(Double)
    pair_ms: Mapped[float] = mapped_column(Double)
    pair_reference_ms: Mapped[float] = mapped_column(Double)
    reason: Mapped[str] = mapped_column(Text)


class PlanRow(Base):
    __tablename__ = "brain_plans"
    __table_args__ = (Index(None, "job_id", "created_at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = _job_fk()
    kind: Mapped[str] = mapped_column(String(KIND_LENGTH))
    current_nodes: Mapped[int] = mapped_column(Integer)
    target_nodes: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(NAME_LENGTH))
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    cpu: Mapped[float] = mapped_column(Double)
    reason: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    applied: Mapped[bool] = mapped_column(Boolean)
    applied_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
