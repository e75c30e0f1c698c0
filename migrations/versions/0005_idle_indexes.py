"""Revision 0005, after 0004 (2026-11-30): partial indexes, so that what an idle cluster asks
every second reads rows in proportion to what it looks for (observers being stopped, observers
nobody holds), not to every observer there is."""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    # The lease renewal: a service's observers that are being deleted or paused.
    op.create_index(
        op.f("ix_observers_stopping"),
        "observers",
        ["service_id"],
        postgresql_where="status IN ('on_deleting', 'pausing')",
    )
    # The leader's audit: live observers that nobody holds.
    op.create_index(
        op.f("ix_observers_unheld"),
        "observers",
        ["dispatched_at"],
        postgresql_where="service_id IS NULL AND status IN ('created', 'processing')",
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_observers_unheld"), table_name="observers")
    op.drop_index(op.f("ix_observers_stopping"), table_name="observers")
