"""Revision 0015, after 0014 (2026-12-05): ``observer_counts``, how many observers there are by
status, kind, pool and holder, kept by triggers on ``observers``, so that what is counted often
(a service's held rows, every service's load, the console's totals, ``/metrics``) reads a few
rows instead of every observer (at 100,000 observers on twenty services, those counts were most
of an idle fleet's reads, and of the console's time).

A row is a delta: the count of a key is the sum of its rows. Triggers add them in the statement
that changes ``observers`` (one row per key an insert or a delete touched; two when an update
moves a row from one key to another, which a checkpoint or a renewal never does), and the
leader folds them into one row per key now and then. Triggers keep the table right whoever
writes: the release before runs unchanged on this schema. ``observers`` is locked while the
table is filled, so that no write falls between the fill and the triggers.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"

KEY = "status, kind, pool, service_id"

FUNCTIONS = {
    "observer_counts_insert": f"""
        INSERT INTO observer_counts ({KEY}, n)
        SELECT {KEY}, count(*) FROM new_rows GROUP BY {KEY};""",
    "observer_counts_delete": f"""
        INSERT INTO observer_counts ({KEY}, n)
        SELECT {KEY}, -count(*) FROM old_rows GROUP BY {KEY};""",
    "observer_counts_update": f"""
        INSERT INTO observer_counts ({KEY}, n)
        VALUES (OLD.status, OLD.kind, OLD.pool, OLD.service_id, -1),
               (NEW.status, NEW.kind, NEW.pool, NEW.service_id, 1);""",
    "observer_counts_truncate": """
        DELETE FROM observer_counts;""",
}

TRIGGERS = {
    "observer_counts_insert": "AFTER INSERT ON observers REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT",
    "observer_counts_delete": "AFTER DELETE ON observers REFERENCING OLD TABLE AS old_rows "
    "FOR EACH STATEMENT",
    # Per row, and only when the row changes key: checkpoints and renewals call nothing.
    "observer_counts_update": "AFTER UPDATE ON observers FOR EACH ROW WHEN "
    "((OLD.status, OLD.kind, OLD.pool, OLD.service_id) "
    "IS DISTINCT FROM (NEW.status, NEW.kind, NEW.pool, NEW.service_id))",
    "observer_counts_truncate": "AFTER TRUNCATE ON observers FOR EACH STATEMENT",
}


def upgrade() -> None:
    op.create_table(
        "observer_counts",
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("pool", sa.Text(), nullable=False),
        sa.Column("service_id", sa.UUID(), nullable=True),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index(op.f("ix_observer_counts_service_id"), "observer_counts", ["service_id"])
    # A handful of live rows under churn: vacuumed after every thousand dead ones, not after a
    # fifth of the table, so that a count's index scan does not step over a busy minute's.
    op.execute(
        "ALTER TABLE observer_counts SET (autovacuum_vacuum_scale_factor = 0, "
        "autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0, "
        "autovacuum_analyze_threshold = 1000)"
    )
    op.execute("LOCK TABLE observers IN SHARE ROW EXCLUSIVE MODE")
    for name, body in FUNCTIONS.items():
        op.execute(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {body} "
            "RETURN NULL; END $$"
        )
        op.execute(f"CREATE TRIGGER {name} {TRIGGERS[name]} EXECUTE FUNCTION {name}()")
    op.execute(
        f"INSERT INTO observer_counts ({KEY}, n) "
        f"SELECT {KEY}, count(*) FROM observers GROUP BY {KEY}"
    )


def downgrade() -> None:
    for name in FUNCTIONS:
        op.execute(f"DROP TRIGGER {name} ON observers")
        op.execute(f"DROP FUNCTION {name}()")
    op.drop_table("observer_counts")
