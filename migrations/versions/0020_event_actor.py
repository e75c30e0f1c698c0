"""Revision 0020, after 0019 (2026-12-07): ``observer_events.actor``, the name of the API token
whose request wrote the event (never the secret); NULL for what the orchestrator did by itself
(takes, releases, moves after a crash) and where the API runs without tokens. A nullable column
(no rewrite), and an index of the rows that have one, built concurrently (``GET /views/actions``
reads the newest actions by token); the release before runs unchanged on this schema (it writes
NULL there)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"


def upgrade() -> None:
    op.add_column("observer_events", sa.Column("actor", sa.Text(), nullable=True))
    # Built without blocking writes (every take writes history), after the column committed.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_observer_events_actor",
            "observer_events",
            ["actor", "id"],
            postgresql_where=sa.text("actor IS NOT NULL"),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_observer_events_actor", table_name="observer_events")
    op.drop_column("observer_events", "actor")
