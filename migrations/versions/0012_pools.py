"""Revision 0012, after 0011 (2026-12-03): pools and kind versions. ``services.pool`` the
pool a service joined, ``observers.pool`` the pool an observer runs in, ``outbox.pool`` the
pool whose work queue a start goes to, each ``'default'`` unless said; ``observers.kind_version``
the version of its kind an observer is pinned to (NULL: any); ``observers.moved_at`` when it was
asked to move (to another pool or version) and has not yet reached a service that can run it
there. Only adds, with constant defaults (no table is rewritten): the release before runs
unchanged on this schema, its rows all in the default pool."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"

TABLES = ("services", "observers", "outbox")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("pool", sa.Text(), nullable=False, server_default="default"))
    op.add_column("observers", sa.Column("kind_version", sa.Text()))
    op.add_column("observers", sa.Column("moved_at", sa.DateTime(timezone=True)))
    # Built without blocking writes: takes and checkpoints go on while it is built.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_observers_moving",
            "observers",
            ["moved_at"],
            postgresql_where=sa.text("moved_at IS NOT NULL"),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_observers_moving", table_name="observers")
    op.drop_column("observers", "moved_at")
    op.drop_column("observers", "kind_version")
    for table in reversed(TABLES):
        op.drop_column(table, "pool")
