"""Revision 0019, after 0018 (2026-12-07): what a service's lease renewal reports besides the
lease. ``services.taking``: the observers it was taking (their starts admitted there); the
leader's audit sends no start anew for an observer a live service is still taking (on a slow
database link a take lasts seconds, and each start sent anew cost that link a round trip to drop
it as stale).
``services.rss_bytes`` and ``services.cpu``: its memory and its share of one core over its last
renewal period, for the console and ``GET /services``. Nullable columns (no rewrite); the
release before runs unchanged on this schema (it never writes them, and reads none of them)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0019"
down_revision = "0018"


def upgrade() -> None:
    op.add_column("services", sa.Column("taking", postgresql.ARRAY(sa.UUID()), nullable=True))
    op.add_column("services", sa.Column("rss_bytes", sa.BigInteger(), nullable=True))
    op.add_column("services", sa.Column("cpu", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("services", "cpu")
    op.drop_column("services", "rss_bytes")
    op.drop_column("services", "taking")
