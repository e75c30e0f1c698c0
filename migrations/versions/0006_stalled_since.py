"""Revision 0006, after 0005 (2026-12-01): ``services.stalled_since``, the mark a service's
watchdog thread sets while kind code blocks its event loop, so that no fast takeover acts on a
process that cannot notice its own session's end."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.add_column("services", sa.Column("stalled_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("services", "stalled_since")
