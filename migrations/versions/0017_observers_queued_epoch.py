"""Revision 0017, after 0016 (2026-12-05): ``observers.queued_epoch``, the epoch of the take
whose copy came by a work-queue delivery (held unacked while it runs) rather than by a directed
start; the current copy came so when it equals ``epoch``. When a holder's process is proven
gone (its broker connection closed), the broker has already requeued those deliveries: the
sweeper leaves such observers to the requeue for a while, and re-dispatches only those that
came directed (``manager/background.py``); ``services.gone_at`` says when the sweeper proved
the process gone, for as long as that lasts (whichever manager leads). Adds nullable columns
(no rewrite); the release before runs unchanged on this schema (its takes never set
``queued_epoch`` and move the epoch past it, so the sweeper re-dispatches their observers at
once, as before)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"


def upgrade() -> None:
    op.add_column(
        "observers",
        sa.Column("queued_epoch", sa.BigInteger(), nullable=True),
    )
    op.add_column("services", sa.Column("gone_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("services", "gone_at")
    op.drop_column("observers", "queued_epoch")
