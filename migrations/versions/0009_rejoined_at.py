"""Revision 0009, after 0008 (2026-12-02): ``services.rejoined_at``, when a service last came
back after losing its lease, so that the leader places no work on a service that cannot keep
one."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    op.add_column("services", sa.Column("rejoined_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("services", "rejoined_at")
