"""Revision 0016, after 0015 (2026-12-05): a unique index on ``leader_leases (name, holder)``.

It makes ``holder`` a key column: a takeover (a new holder) then takes the row's strongest lock
and waits for every transaction that read the lease ``FOR KEY SHARE``, while a renewal (the
same holder, a new expiry) does not. The leader's loops open each transaction that way
(``orch_manager.leader``), so an old leader's write either commits before its successor's term
begins, or finds the lease gone and writes nothing. Only adds an index: the release before
runs unchanged on this schema."""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"


def upgrade() -> None:
    op.create_index(
        op.f("ix_leader_leases_name_holder"), "leader_leases", ["name", "holder"], unique=True
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_leader_leases_name_holder"), table_name="leader_leases")
