"""Node checks: every node's pre-flight check with its numbers, which the
straggler detector remembers.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dlfleet.brain.migrations.versions.r0001_initial import NAME, _id, _job_id, datetime_type

revision = "0002"
down_revision: str | None = "0001"
branch_labels = None
depends_on = None

RULE = 64


def upgrade() -> None:
    op.create_table(
        "brain_node_checks",
        _id(),
        *_job_id("brain_node_checks"),
        sa.Column("node", sa.String(NAME), nullable=False),
        sa.Column("at", datetime_type(), nullable=False),
        sa.Column("faulty", sa.Boolean(), nullable=False),
        sa.Column("rule", sa.String(RULE), nullable=False),
        sa.Column("compute_ms", sa.Double(), nullable=False),
        sa.Column("compute_reference_ms", sa.Double(), nullable=False),
        sa.Column("pair_ms", sa.Double(), nullable=False),
        sa.Column("pair_reference_ms", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    op.create_index("ix_brain_node_checks_job_id_at", "brain_node_checks", ["job_id", "at"])


def downgrade() -> None:
    op.drop_table("brain_node_checks")
