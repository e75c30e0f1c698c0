"""Revision 0003, after 0002 (2026-11-30): restart budget window (observers.restarted_at); typed
outbox routes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.add_column("observers", sa.Column("restarted_at", sa.DateTime(timezone=True)))
    op.add_column("outbox", sa.Column("route", sa.Text()))
    op.add_column("outbox", sa.Column("service_id", postgresql.UUID(as_uuid=True)))
    op.execute(
        "UPDATE outbox SET route = CASE WHEN target = 'start' THEN 'work' "
        "WHEN target = 'control' THEN 'broadcast' ELSE 'service' END, "
        "service_id = CASE WHEN target LIKE 'direct:%' "
        "THEN CAST(substr(target, 8) AS uuid) END"
    )
    op.alter_column("outbox", "route", nullable=False)
    op.drop_column("outbox", "target")
    op.create_check_constraint(
        op.f("ck_outbox_route_valid"),
        "outbox",
        "route IN ('work', 'broadcast', 'service', 'errors')",
    )
    op.create_check_constraint(
        op.f("ck_outbox_service_route"), "outbox", "(route = 'service') = (service_id IS NOT NULL)"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_outbox_service_route"), "outbox", type_="check")
    op.drop_constraint(op.f("ck_outbox_route_valid"), "outbox", type_="check")
    op.add_column("outbox", sa.Column("target", sa.Text()))
    op.execute(
        "UPDATE outbox SET target = CASE route WHEN 'work' THEN 'start' "
        "WHEN 'broadcast' THEN 'control' ELSE 'direct:' || service_id::text END"
    )
    op.alter_column("outbox", "target", nullable=False)
    op.drop_column("outbox", "service_id")
    op.drop_column("outbox", "route")
    op.drop_column("observers", "restarted_at")
