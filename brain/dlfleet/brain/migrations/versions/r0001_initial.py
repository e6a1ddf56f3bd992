"""The first schema: jobs, rounds, node samples, failures, plans.

Revision ID: 0001
Revises: none
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql
from sqlalchemy.schema import SchemaItem

revision = "0001"
down_revision: str | None = None
branch_labels = None
depends_on = None

NAME = 255
KIND = 16


def datetime_type() -> sa.types.TypeEngine[datetime]:
    """Naive UTC; MySQL's DATETIME keeps microseconds only with fsp=6."""
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _id() -> sa.Column[int]:
    return sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        autoincrement=True,
        nullable=False,
    )


def _job_id(table: str) -> list[SchemaItem]:
    return [
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["brain_jobs.id"],
            name=f"fk_{table}_job_id_brain_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=f"pk_{table}"),
    ]


def upgrade() -> None:
    op.create_table(
        "brain_jobs",
        _id(),
        sa.Column("name", sa.String(NAME), nullable=False),
        sa.Column("signature", sa.String(NAME), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(KIND), nullable=False),
        sa.Column("created_at", datetime_type(), nullable=False),
        sa.Column("updated_at", datetime_type(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_brain_jobs"),
        sa.UniqueConstraint("name", name="uq_brain_jobs_name"),
    )
    op.create_index("ix_brain_jobs_signature", "brain_jobs", ["signature"])
    op.create_table(
        "brain_rounds",
        _id(),
        *_job_id("brain_rounds"),
        sa.Column("round", sa.BigInteger(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("started_at", datetime_type(), nullable=False),
        sa.Column("ended_at", datetime_type(), nullable=False),
        sa.Column("samples_per_s", sa.Double(), nullable=False),
        sa.Column("step_time_mean_s", sa.Double(), nullable=False),
        sa.Column("step_time_p50_s", sa.Double(), nullable=False),
        sa.Column("step_time_p90_s", sa.Double(), nullable=False),
        sa.UniqueConstraint("job_id", "round", name="uq_brain_rounds_job_id_round"),
    )
    op.create_table(
        "brain_node_samples",
        _id(),
        *_job_id("brain_node_samples"),
        sa.Column("node", sa.String(NAME), nullable=False),
        sa.Column("round", sa.BigInteger(), nullable=False),
        sa.Column("at", datetime_type(), nullable=False),
        sa.Column("cpu_percent", sa.Double(), nullable=False),
        sa.Column("memory_rss_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_limit_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_request_bytes", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_s", sa.Double(), nullable=False),
        sa.Column("step_time_s", sa.Double(), nullable=False),
    )
    op.create_index("ix_brain_node_samples_job_id_at", "brain_node_samples", ["job_id", "at"])
    op.create_index("ix_brain_node_samples_job_id_node", "brain_node_samples", ["job_id", "node"])
    op.create_table(
        "brain_failures",
        _id(),
        *_job_id("brain_failures"),
        sa.Column("node", sa.String(NAME), nullable=False),
        sa.Column("kind", sa.String(KIND), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("at", datetime_type(), nullable=False),
    )
    op.create_index("ix_brain_failures_job_id_at", "brain_failures", ["job_id", "at"])
    op.create_table(
        "brain_plans",
        _id(),
        *_job_id("brain_plans"),
        sa.Column("kind", sa.String(KIND), nullable=False),
        sa.Column("current_nodes", sa.Integer(), nullable=False),
        sa.Column("target_nodes", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(NAME), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("cpu", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("created_at", datetime_type(), nullable=False),
        sa.Column("applied", sa.Boolean(), nullable=False),
        sa.Column("applied_at", datetime_type(), nullable=True),
    )
    op.create_index("ix_brain_plans_job_id_created_at", "brain_plans", ["job_id", "created_at"])


def downgrade() -> None:
    for table in ("brain_plans", "brain_failures", "brain_node_samples", "brain_rounds"):
        op.drop_table(table)
    op.drop_table("brain_jobs")
