"""The service's batch writes find their rows by primary key, however stale the planner's
statistics are. In bulk intake the observers table grows faster than ANALYZE runs; planned on
statistics that say "this service holds nothing", a checkpoint of 40 rows read every row the
service held (25-130 ms a batch at 10,000 held, growing with every observer taken), and a
join with the batch's arrays became a nested loop over both (a 1,000-row batch: a million
comparisons)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from observer_service import queries as q
from observer_service.store import SERVER_SETTINGS
from orch_contracts.settings import asyncpg_dsn
from orch_manager import queries as mq
from orch_manager.store import positional

HELD = 5000


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection as the service's pool makes them."""
    c = await asyncpg.connect(asyncpg_dsn(database_url), server_settings=SERVER_SETTINGS)
    try:
        yield c
    finally:
        await c.close()


async def _stale_world(conn: asyncpg.Connection) -> uuid.UUID:
    """A service holding HELD rows the statistics know nothing of (analysed when it held none)."""
    me = uuid.uuid4()
    await conn.execute("ALTER TABLE observers SET (autovacuum_enabled = false)")
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
        "VALUES ($1, 's', 100000, 1, clock_timestamp() + interval '1 hour')",
        me,
    )
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT gen_random_uuid(), 'c' || g, 'ticker', 'created', gen_random_uuid() "
        "FROM generate_series(1, 20) g"
    )
    await conn.execute("ANALYZE observers")
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch) "
        "SELECT gen_random_uuid(), 'p' || g, 'ticker', 'processing', gen_random_uuid(), $1, 1 "
        "FROM generate_series(1, $2::int) g",
        me,
        HELD,
    )
    return me


async def _plan(conn: asyncpg.Connection, sql: str, *args: object) -> str:
    """The generic plan (the one a prepared statement settles on), executed and rolled back."""
    async with conn.transaction():
        await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        rows = await conn.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
        plan = json.loads(rows[0][0])[0]
        await conn.execute("SELECT 1")  # the transaction is rolled back below
        raise _Rollback(plan)


class _Rollback(Exception):
    def __init__(self, plan: dict[str, object]) -> None:
        self.plan = plan


def _scans(node: dict[str, Any], relation: str = "observers") -> list[tuple[str, str, int]]:
    """(node type, index, rows read) of every scan of ``relation`` in the plan, and of every
    join by the rows its filter compared and threw away."""
    out = []
    if "Rows Removed by Join Filter" in node:
        removed = int(node["Rows Removed by Join Filter"])
        out.append((str(node["Node Type"]), "join filter", removed))
    if node.get("Relation Name") == relation:
        rows = int(node.get("Actual Rows", 0)) + int(node.get("Rows Removed by Filter", 0))
        out.append((str(node["Node Type"]), str(node.get("Index Name", "")), rows))
    for child in node.get("Plans", []):
        out += _scans(child, relation)
    return out


async def _explained(
    conn: asyncpg.Connection, sql: str, *args: object, relation: str = "observers"
) -> list[tuple[str, str, int]]:
    try:
        await _plan(conn, sql, *args)
    except _Rollback as done:
        return _scans(done.plan["Plan"], relation)  # type: ignore[arg-type]
    raise AssertionError("unreachable")


@pytest.mark.parametrize("size", [40, 1000])
@pytest.mark.parametrize("statement", ["checkpoint", "release", "take", "control"])
async def test_a_batch_write_reads_only_its_own_rows(
    conn: asyncpg.Connection, statement: str, size: int
) -> None:
    me = await _stale_world(conn)
    rows = await conn.fetch(
        "SELECT id, dispatch_id FROM observers WHERE service_id = $1 LIMIT $2", me, size
    )
    ids = [r["id"] for r in rows]
    keys = [q.copy_key(i, 1) for i in ids]
    if statement == "take":  # taken again by its holder (as after a lost reply)
        seen = {
            str(r["id"]): {
                "epoch": 1,
                "dispatch_id": str(r["dispatch_id"]),
                "status": "processing",
                "holder": str(me),
                "detail": None,
                "holder_key": None,
            }
            for r in rows
        }
        scans = await _explained(conn, q.TAKE, ids, me, json.dumps(seen))
    elif statement == "control":  # the check of a burst of cancels
        scans = await _explained(conn, q.CONTROL_FACTS, ids, me)
    elif statement == "checkpoint":
        commits = json.dumps({k: {"s": {"n": 1}, "r": [{"n": 1}], "q": 1} for k in keys})
        scans = await _explained(conn, q.COMMIT, ids, me, commits)
    else:
        scans = await _explained(
            conn, q.RELEASE, ids, me, json.dumps(dict.fromkeys(keys, True)), "t"
        )
    read = sum(rows for _, _, rows in scans)
    assert scans, "the plan names the observers table"
    assert read <= 4 * len(ids), f"read {read} rows of observers for {len(ids)}: {scans}"


async def test_the_held_rows_check_reads_no_observer(
    conn: asyncpg.Connection,
) -> None:
    """Each service counts what it holds every ``check_every``. Measured on 20 services at
    100,000 observers, counting the rows it held (by the index of its holder) made the fleet's
    idle reads grow with its observers, 5.3 times from 10,000 to 100,000. It reads the counts
    the triggers keep now: a few rows of its own by their holder index, in this world too
    (statistics taken mid-intake, when nobody held anything)."""
    me = uuid.uuid4()
    others = [uuid.uuid4() for _ in range(10)]
    await conn.execute("ALTER TABLE observers SET (autovacuum_enabled = false)")
    for i, sid in enumerate([me, *others]):
        await conn.execute(
            "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
            "VALUES ($1, $2, 100000, $3, clock_timestamp() + interval '1 hour')",
            sid,
            f"s{i}",
            i,
        )
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT gen_random_uuid(), 'o' || g, 'ticker', 'created', gen_random_uuid() "
        "FROM generate_series(1, 20500) g"
    )
    await conn.execute(
        "UPDATE observers SET status = 'processing', service_id = $1, epoch = 1 "
        "WHERE CAST(right(name, -1) AS int) > 20490",
        others[0],
    )
    await conn.execute("ANALYZE observers")  # mid-intake: nearly all created, nobody holding
    await conn.execute(
        "UPDATE observers SET status = 'processing', epoch = 1, "
        "service_id = CASE WHEN CAST(right(name, -1) AS int) <= 500 THEN $1 "
        "ELSE (CAST($2 AS uuid[]))[1 + CAST(right(name, -1) AS int) % 10] END "
        "WHERE service_id IS NULL",
        me,
        others,
    )
    assert await conn.fetchval(q.HELD_COUNT, me) == 500  # before the leader's fold
    assert await _explained(conn, q.HELD_COUNT, me) == []
    await conn.execute(mq.FOLD_COUNTS)
    assert await conn.fetchval(q.HELD_COUNT, me) == 500
    counts = await _explained(conn, q.HELD_COUNT, me, relation="observer_counts")
    read = sum(rows for _, _, rows in counts)
    assert read <= 20, f"read {read} count rows to count what one service holds: {counts}"


async def test_the_audits_look_for_idle_pools_reads_only_recent_takes(
    conn: asyncpg.Connection,
) -> None:
    """The audit asks four times a second which pools took nothing lately. As an anti-join it
    was planned as a sequential scan of every observer: measured on an idle fleet of 20
    services, 2 to 4 scans a second of the whole table (184,738 rows read a second at 100,000
    observers). It reads the newest takes by the index on started_at."""
    await conn.execute("ALTER TABLE observers SET (autovacuum_enabled = false)")
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
        "SELECT gen_random_uuid(), 's' || g, 1000, g, clock_timestamp() + interval '1 hour' "
        "FROM generate_series(1, 20) g"
    )
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT gen_random_uuid(), 'o' || g, 'ticker', 'created', gen_random_uuid() "
        "FROM generate_series(1, 10000) g"
    )
    await conn.execute("ANALYZE observers")  # mid-intake: nothing taken yet
    await conn.execute(
        "UPDATE observers SET status = 'processing', epoch = 1, "
        "started_at = now() - interval '1 hour' + CAST(right(name, -1) AS int) * interval '1 ms'"
    )
    sql, _ = positional(mq.IDLE_POOLS)
    scans = await _explained(conn, sql, 0.5)
    assert [s for s in scans if s[0] == "Seq Scan"] == [], scans
    assert sum(rows for _, _, rows in scans) == 0, scans
    assert await conn.fetchval(sql, 0.5) == "default"


async def test_the_sweepers_look_for_orphans_reads_no_observer(database_url: str) -> None:
    """The sweeper asks four times a second whether a dead service still holds anything. Once a
    dead service's row was kept (after any crash, for the retention's day), the generic plan of
    that EXISTS on the observers was a sequential scan of every row: 420,000 rows read a second
    at 100,000 observers on the fleet after its kills. It reads the counts now."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))  # as the manager's pool makes them
    try:
        await _orphans_looked_for(conn)
    finally:
        await conn.close()


async def _orphans_looked_for(conn: asyncpg.Connection) -> None:
    lives = [uuid.uuid4() for _ in range(20)]
    dead = uuid.uuid4()
    live = lives[0]
    for i, sid in enumerate([*lives, dead]):
        await conn.execute(
            "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, "
            "is_deleted) VALUES ($1, $2, 100000, $3, clock_timestamp() + interval '1 hour', $4)",
            sid,
            f"s{i}",
            i,
            sid == dead,
        )
    await conn.execute(  # a fleet: 20 services of 5,000 each
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch) "
        "SELECT gen_random_uuid(), 'o' || g, 'ticker', 'processing', gen_random_uuid(), "
        "(CAST($1 AS uuid[]))[1 + g % 20], 1 FROM generate_series(1, 100000) g",
        lives,
    )
    await conn.execute("ANALYZE")
    sql, _ = positional(mq.ANY_ORPHAN)
    # The plan a prepared statement settles on after its fifth run: generic, as EXECUTE gives
    # it (an EXPLAIN with parameters plans for their values).
    await conn.execute(f"PREPARE look AS {sql}")
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    explained = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE look('{{{dead}}}')")
    await conn.execute("RESET plan_cache_mode")
    assert _scans(json.loads(explained)[0]["Plan"]) == []
    assert await conn.fetchval(sql, [dead]) is False
    await conn.execute("UPDATE observers SET service_id = $1 WHERE name IN ('o1', 'o2')", dead)
    assert await conn.fetchval(sql, [dead]) is True
    assert await conn.fetchval(sql, [live]) is True


async def test_the_movers_first_look_reads_no_observer_when_none_moves(
    conn: asyncpg.Connection,
) -> None:
    """The mover looks for observers asked to move twice a second; on an idle fleet of 20
    services its join was planned as a sequential scan of every observer. Its first look reads
    the partial index of moving observers, and nothing else."""
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT gen_random_uuid(), 'o' || g, 'ticker', 'created', gen_random_uuid() "
        "FROM generate_series(1, 20000) g"
    )
    sql, _ = positional(mq.FIRST_MOVING)
    scans = await _explained(conn, sql)
    assert [index for _, index, _ in scans] == ["ix_observers_moving"], scans
    assert await conn.fetchval(sql) is None


async def test_the_output_relays_look_reads_no_observer_when_no_output_waits(
    conn: asyncpg.Connection,
) -> None:
    """The output relay looks for commits nobody published several times a second. Joined to
    the observers, it was planned as a scan of every observer (measured on an idle fleet of 20
    services with no output at all); each commit's observer is now read by its key."""
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT gen_random_uuid(), 'o' || g, 'ticker', 'created', gen_random_uuid() "
        "FROM generate_series(1, 20000) g"
    )
    await conn.execute("ANALYZE observers")
    sql, _ = positional(mq.OUTPUTS_LEFT)
    scans = await _explained(conn, sql, 2.0, 2000)
    assert sum(rows for _, _, rows in scans) == 0, scans
