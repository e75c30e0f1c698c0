"""Revision 0013, after 0012 (2026-12-03): ``outbox.trace``, the W3C trace context a message
was written in (NULL when tracing is off), so that a message the relay publishes later stays in
its request's trace. Only adds a nullable column: the release before runs unchanged on this
schema."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    op.add_column("outbox", sa.Column("trace", JSONB()))


def downgrade() -> None:
    op.drop_column("outbox", "trace")
