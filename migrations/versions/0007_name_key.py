"""Revision 0007, after 0006 (2026-12-02): ``observers.name_key``, what names that look alike
share (``orch_contracts.names.name_key``), unique among observers that are not deleted, as names
are.

Existing rows get their key. Live observers whose names already look alike (created before
keys existed) are not refused by the migration: the oldest of them holds the key, the others
keep their names and no key (NULL, which the unique index does not compare), so nothing about
them changes; a new observer whose name looks like theirs is refused as long as the oldest
lives. Deleted observers get their key too (the index leaves them out).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from orch_contracts.names import name_key

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    op.add_column("observers", sa.Column("name_key", sa.Text()))
    conn = op.get_bind()
    rows = conn.execute(
        sa.text("SELECT id, name, status FROM observers ORDER BY created_at, id")
    ).all()
    held: set[str] = set()
    keys = []
    for row in rows:
        key = name_key(row.name)
        stored: str | None = key
        if row.status != "deleted":
            if key in held:
                stored = None  # a look-alike of an older live observer: see the docstring
            else:
                held.add(key)
        keys.append({"id": row.id, "key": stored})
    if keys:
        conn.execute(sa.text("UPDATE observers SET name_key = :key WHERE id = :id"), keys)
    op.create_index(
        "uq_observers_live_name_key",
        "observers",
        ["name_key"],
        unique=True,
        postgresql_where=sa.text("status <> 'deleted'"),
    )


def downgrade() -> None:
    op.drop_index("uq_observers_live_name_key", table_name="observers")
    op.drop_column("observers", "name_key")
