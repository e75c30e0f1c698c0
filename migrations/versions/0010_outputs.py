"""Revision 0010, after 0009 (2026-12-02): what observers emit. ``observer_outputs`` holds
committed records until the broker confirms them; ``observers.output_seq`` the last committed
seq, ``committed_at`` the current copy's last commit, ``commit_no`` its number (a commit
retried after a lost answer lands once)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.add_column(
        "observers", sa.Column("output_seq", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column("observers", sa.Column("committed_at", sa.DateTime(timezone=True)))
    op.add_column(
        "observers", sa.Column("commit_no", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.create_table(
        "observer_outputs",
        sa.Column("observer_id", sa.UUID(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("records", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "committed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.Column("service_id", sa.UUID(), nullable=False),
        sa.PrimaryKeyConstraint("observer_id", "seq", name=op.f("pk_observer_outputs")),
    )
    op.create_index("ix_observer_outputs_service_id", "observer_outputs", ["service_id"])
    op.create_index("ix_observer_outputs_committed_at", "observer_outputs", ["committed_at"])


def downgrade() -> None:
    op.drop_index("ix_observer_outputs_committed_at", table_name="observer_outputs")
    op.drop_index("ix_observer_outputs_service_id", table_name="observer_outputs")
    op.drop_table("observer_outputs")
    op.drop_column("observers", "commit_no")
    op.drop_column("observers", "committed_at")
    op.drop_column("observers", "output_seq")
