"""Revision 0018, after 0017 (2026-12-06): an index on ``outbox (service_id)`` of the records
sent to one service. A service reads its directed starts from the outbox at each lease renewal
when the broker has not delivered them (publishers blocked by a broker alarm): failover of
observers that no broker delivery holds runs through the alarm. Only adds an index: the release
before runs unchanged on this schema."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"


def upgrade() -> None:
    op.create_index(
        "ix_outbox_service",
        "outbox",
        ["service_id"],
        postgresql_where=sa.text("route = 'service'"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_service", table_name="outbox")
