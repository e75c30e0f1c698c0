"""Revision 0002, after 0001 (2026-11-29): index observers.started_at (the audit's progress
check).
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_index("ix_observers_started_at", "observers", ["started_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_observers_started_at", table_name="observers")
