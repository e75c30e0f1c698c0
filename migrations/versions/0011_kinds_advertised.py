"""Revision 0011, after 0010 (2026-12-03): kinds where they really are. ``services.kinds`` the
kinds a service runs, as it advertises them when it joins (NULL: a service of an earlier release,
which ran every kind); ``observers.waiting`` why nobody runs an observer that waits for a
service able to (cleared by the take that starts it). Both only add: the release before runs
unchanged on this schema."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    op.add_column("services", sa.Column("kinds", postgresql.JSONB(astext_type=sa.Text())))
    op.add_column("observers", sa.Column("waiting", sa.Text()))


def downgrade() -> None:
    op.drop_column("observers", "waiting")
    op.drop_column("services", "kinds")
