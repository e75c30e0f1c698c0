"""Revision 0004, after 0003 (2026-11-30): pause and resume: statuses pausing and paused."""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"

_BEFORE = "'created', 'processing', 'on_deleting', 'deleted', 'failed'"
_AFTER = _BEFORE + ", 'pausing', 'paused'"


def upgrade() -> None:
    op.drop_constraint(op.f("ck_observers_status_valid"), "observers", type_="check")
    op.create_check_constraint(
        op.f("ck_observers_status_valid"), "observers", f"status IN ({_AFTER})"
    )


def downgrade() -> None:
    op.execute(
        "UPDATE observers SET status = 'failed', service_id = NULL, "
        "last_error = 'paused before a downgrade; restart it to run it again' "
        "WHERE status IN ('pausing', 'paused')"
    )
    op.drop_constraint(op.f("ck_observers_status_valid"), "observers", type_="check")
    op.create_check_constraint(
        op.f("ck_observers_status_valid"), "observers", f"status IN ({_BEFORE})"
    )
