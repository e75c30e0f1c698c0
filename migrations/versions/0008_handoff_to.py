"""Revision 0008, after 0007 (2026-12-02): ``observers.handoff_to``, the move the leader
decided, written with its handoff message, so that a holder hands over only what the leader
recorded and not whatever a message on the broker names."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.add_column("observers", sa.Column("handoff_to", UUID(as_uuid=True)))


def downgrade() -> None:
    op.drop_column("observers", "handoff_to")
