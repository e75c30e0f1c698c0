"""index observers.started_at (the audit's progress check)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_observers_started_at", "observers", ["started_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_observers_started_at", table_name="observers")
