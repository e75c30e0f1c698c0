"""Revision 0018, after 0017 (2026-12-06): ``observers.directed_to``, the service a directed
start was sent to (a re-dispatch of the leader, a handoff), kept until a take clears it. The
target's lease renewal reads the observers directed to it that nobody took within a renewal
interval and takes them from the database: a directed start lost with a control queue (its
service cut off from the broker), or never published (publishers blocked by a broker alarm),
still reaches its service. Adds a nullable column (no rewrite) and a partial index, built
concurrently; the release before runs unchanged on this schema (it never sets the column;
its takes leave it, which only costs the target one take that finds the observer held)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"


def upgrade() -> None:
    op.add_column("observers", sa.Column("directed_to", sa.UUID(), nullable=True))
    # Built without blocking writes, and after the column's transaction committed: its lock
    # (ACCESS EXCLUSIVE) held for a build over a large table would stop every lease renewal
    # (they read the table), and every service would lose its lease at once.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_observers_directed_to",
            "observers",
            ["directed_to"],
            postgresql_where=sa.text("directed_to IS NOT NULL"),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_observers_directed_to", table_name="observers")
    op.drop_column("observers", "directed_to")
