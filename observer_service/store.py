"""The service's database edge: ``PgStore`` (observer rows) and ``PgLeaseDatabase`` (the lease
and the session that holds the service's advisory lock). SQL lives in ``queries``; driver errors
become ``DatabaseUnavailable`` here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg

from observer_service import queries as q
from observer_service.headroom import Usage
from observer_service.ports import (
    LOCKED,
    Checkpoint,
    ControlFacts,
    Copy,
    ErrorRecord,
    Holding,
    Locked,
    Renewal,
    Seen,
    Written,
)
from observer_service.take import Decision
from orch_contracts import pgconnect
from orch_contracts.errors import DatabaseUnavailable, database_errors
from orch_contracts.kinds import RestartPolicy
from orch_contracts.messages import StartMessage
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.statuses import ObserverStatus

log = logging.getLogger(__name__)


class PgStore:
    def __init__(self, pool: asyncpg.Pool, me: uuid.UUID) -> None:
        self.pool = pool
        self.me = me

    async def read_facts(self, observer_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Seen]:
        """Every observer and its holder with one read (``queries.FACTS``): a live holder's
        lock is tried for the statement only, so a free one proves its session over."""
        with database_errors():
            rows = await self.pool.fetch(q.FACTS, list(observer_ids), self.me)
        return {row["id"]: _seen(row) for row in rows}

    async def compare_and_set(
        self,
        decision: Decision,
        rows: Sequence[Seen],
        queued: Collection[uuid.UUID] = (),
        dispatches: Mapping[uuid.UUID, uuid.UUID] | None = None,
    ) -> Written:
        """One statement for the batch (``queries.TAKE`` or ``COMPLETE_STOP``), which skips a
        locked row: the new epoch of every row written, and every row found as seen."""
        sql = _CAS[decision]

        def key(r: Seen) -> int | None:
            """The lock key found free, for a take from a live holder: the write holds only
            while the holder's row still names it (the holder has not come back on a new
            session meanwhile)."""
            return r.holder_key if r.holder_live and r.holder != self.me else None

        seen = {
            str(r.observer_id): {
                "epoch": r.epoch,
                "dispatch_id": str(r.dispatch_id),
                "status": r.status.value,
                "holder": None if r.holder is None else str(r.holder),
                "detail": f"from {r.holder}" if r.holder else None,
                "holder_key": key(r),
                "pool": r.pool,
                "kind_version": r.kind_version,
                "queued": r.observer_id in queued,
                "take_dispatch": str((dispatches or {}).get(r.observer_id, r.dispatch_id)),
            }
            for r in rows
        }
        with database_errors():
            found = await self.pool.fetch(
                sql, [r.observer_id for r in rows], self.me, json.dumps(seen)
            )
        epochs = {r["id"]: r["epoch"] for r in found if r["written"]}
        resumed = {}
        if decision is Decision.TAKE:
            resumed = {
                r["id"]: (json.loads(r["checkpoint"]) if r["checkpoint"] else None, r["output_seq"])
                for r in found
                if r["written"]
            }
        return Written(epochs, frozenset(r["id"] for r in found) - epochs.keys(), resumed)

    async def checkpoint_many(self, items: Sequence[Checkpoint]) -> list[bool | Locked]:
        """One statement for every commit (``queries.COMMIT``); one row per copy (observer and
        epoch), the newest state of each copy winning, so a stale copy's write never hides the
        current's. A row locked by another transaction is skipped (LOCKED), the rest land at
        once. A copy commits one at a time: two commits of one copy are never in one batch."""
        newest = {(c.observer_id, c.epoch): c for c in items}
        # The states and records are JSON already: the object is written around them.
        body = ",".join(
            f'"{q.copy_key(c.observer_id, c.epoch)}":{_commit_json(c)}' for c in newest.values()
        )
        with database_errors():
            rows = await self.pool.fetch(
                q.COMMIT, list({c.observer_id for c in newest.values()}), self.me, "{" + body + "}"
            )
        out_of_step = set()
        for r in rows:
            c = newest.get((r["id"], r["epoch"]))
            if c is not None and r["output_seq"] not in (c.first_seq - 1, _last_seq(c)):
                # A bug: refused like a fence (the copy stops; the next take reads the row
                # again), without failing the batch's other commits.
                log.error(
                    "a commit of %s is out of step: it expected seq %d, the row holds %d",
                    c.observer_id,
                    c.first_seq - 1,
                    r["output_seq"],
                )
                out_of_step.add((r["id"], r["epoch"]))
        rows = [r for r in rows if (r["id"], r["epoch"]) not in out_of_step]
        return _answers(rows, [Copy(c.observer_id, c.epoch) for c in items], lambda _: True, False)

    async def outputs_backlog(self, observer_ids: Sequence[uuid.UUID]) -> list[Committed]:
        with database_errors():
            rows = await self.pool.fetch(q.BACKLOG, list(observer_ids))
        return [Committed.from_row(r) for r in rows]

    async def delete_published(self, commits: Sequence[tuple[uuid.UUID, int]]) -> None:
        with database_errors():
            await self.pool.execute(
                q.DELETE_PUBLISHED, [c[0] for c in commits], [c[1] for c in commits]
            )

    async def release_many(
        self, copies: Sequence[Copy], detail: str
    ) -> list[ObserverStatus | Locked | None]:
        """Release stopped copies (or complete their delete); None where the copy was fenced,
        LOCKED where its row was locked by another transaction."""
        with database_errors():
            rows = await self.pool.fetch(
                q.RELEASE,
                list({c[0] for c in copies}),
                self.me,
                json.dumps({q.copy_key(*c): True for c in copies}),
                detail,
            )
        return _answers(rows, copies, lambda r: ObserverStatus(r["status"]), None)

    async def record_error(
        self, copy: Copy, error: str, policy: RestartPolicy
    ) -> ErrorRecord | None:
        with database_errors():
            row = await self.pool.fetchrow(
                q.RECORD_ERROR,
                copy[0],
                self.me,
                copy[1],
                error,
                policy.reset_after,
                policy.max_restarts,
            )
        if row is None:
            return None
        return ErrorRecord(restarts=row["restart_count"], failed=row["status"] == "failed")

    async def fail(self, copy: Copy, error: str) -> bool:
        with database_errors():
            row = await self.pool.fetchrow(q.FAIL, copy[0], self.me, copy[1], error)
        return row is not None

    async def blame(self, observer_id: uuid.UUID, reason: str) -> bool:
        with database_errors():
            row = await self.pool.fetchrow(q.BLAME, observer_id, self.me, reason)
        return row is not None

    async def pass_on(self, observer_id: uuid.UUID, dispatch_id: uuid.UUID, why: str) -> bool:
        with database_errors():
            row = await self.pool.fetchrow(q.PASS_ON, observer_id, dispatch_id, why)
        return row is not None

    async def reconcile(self, running: set[uuid.UUID]) -> int:
        with database_errors():
            rows = await self.pool.fetch(q.RECONCILE, list(running), self.me)
        return len(rows)

    async def held_count(self) -> int:
        with database_errors():
            return int(await self.pool.fetchval(q.HELD_COUNT, self.me))

    async def held_copies(self) -> set[Copy]:
        with database_errors():
            rows = await self.pool.fetch(q.HELD_COPIES, self.me)
        return {Copy(r["id"], r["epoch"]) for r in rows}

    async def mark_queued(self, marks: Mapping[Copy, bool]) -> set[uuid.UUID]:
        if not marks:
            return set()
        with database_errors():
            rows = await self.pool.fetch(
                q.MARK_QUEUED,
                list({c.observer_id for c in marks}),
                self.me,
                json.dumps({q.copy_key(*c): yes for c, yes in marks.items()}),
            )
        return {r["id"] for r in rows}

    async def control_facts(self, observer_ids: Sequence[uuid.UUID]) -> ControlFacts:
        with database_errors():
            rows = await self.pool.fetch(q.CONTROL_FACTS, list(observer_ids), self.me)
        return ControlFacts(
            draining=bool(rows[0]["draining"]),
            observers={
                r["id"]: Holding(
                    ObserverStatus(r["status"]), r["service_id"], r["epoch"], r["handoff_to"]
                )
                for r in rows
                if r["id"] is not None
            },
        )


class ThreadWrites:
    """The writes the watchdog thread makes while the service's event loop is blocked: on a
    connection and an event loop of its own, kept between writes (a stall is marked within
    milliseconds of being seen)."""

    def __init__(self, dsn: str, me: uuid.UUID) -> None:
        self.dsn = dsn
        self.me = me
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: asyncpg.Connection | None = None

    def blame(self, observer_id: uuid.UUID, reason: str) -> None:
        """Fail the observer whose step outlived the lease."""
        self._run(q.BLAME, observer_id, self.me, reason)

    def mark_stalled(self) -> None:
        """A step blocks the loop: no fast takeover of this service until its next renewal."""
        self._run(q.MARK_STALLED, self.me)

    def _run(self, query: str, *args: object) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._execute(query, *args))

    async def _execute(self, query: str, *args: object) -> None:
        with database_errors():
            conn = self._conn
            if conn is None or conn.is_closed():
                conn = self._conn = await pgconnect.connect(self.dsn, timeout=2)
            try:
                await conn.execute(query, *args, timeout=2)
            except BaseException:
                self._conn = None
                conn.terminate()
                raise


#: Settings of every service connection. Its statements reach rows by key (an observer's id,
#: its own service id): never by reading the table. With the table growing faster than ANALYZE
#: runs (bulk intake), a generic plan costed on stale statistics would otherwise read every row
#: for each batch of 40 (``tests/integration/test_store_plans.py``). No statement waits long
#: for a lock (the batches skip locked rows; the rest fail with RowLocked and are retried), and
#: none keeps a transaction open: a backend must never hold our rows longer than a lease.
SERVER_SETTINGS = {
    "enable_seqscan": "off",
    "lock_timeout": "1s",
    "idle_in_transaction_session_timeout": "5s",
}


async def keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset, a no-op: the service's statements leave no session state behind (no
    LISTEN, cursor, session lock or setting; their advisory locks end with the statement), so a
    connection goes back as it is, without the reset round trip asyncpg makes by default."""


async def prepare_connection(conn: asyncpg.Connection) -> None:
    """Prepare the statements of a takeover and of running copies on a new pool connection,
    with empty arguments (they change nothing): the first takeover after a quiet spell then
    waits for neither statement preparation nor type introspection."""
    nobody = uuid.UUID(int=0)
    await conn.fetch(q.FACTS, [], nobody)
    for cas in (q.TAKE, q.COMPLETE_STOP):
        await conn.fetch(cas, [], nobody, "{}")
    await conn.fetch(q.COMMIT, [], nobody, "{}")
    await conn.fetch(q.RELEASE, [], nobody, "{}", "")
    await conn.fetch(q.CONTROL_FACTS, [], nobody)


A = TypeVar("A")


def _commit_json(c: Checkpoint) -> str:
    state = "" if c.state_json is None else f'"s":{c.state_json},'
    records = f'"r":[{",".join(c.records)}],' if c.records else ""
    return f'{{{state}{records}"q":{c.first_seq}}}'


def _last_seq(c: Checkpoint) -> int:
    return c.first_seq - 1 + len(c.records)


def _answers(
    rows: Sequence[asyncpg.Record],
    copies: Sequence[Copy],
    written: Callable[[asyncpg.Record], A],
    fenced: A,
) -> list[A | Locked]:
    """Per copy, what a ``queries.skipping_locked`` statement made of it: ``written(row)``
    where its row was written, LOCKED where it was ours but skipped as locked, else fenced."""
    done: dict[tuple[uuid.UUID, int], A] = {}
    ours: set[tuple[uuid.UUID, int]] = set()
    for r in rows:
        if r["written"]:
            done[(r["id"], r["epoch"])] = written(r)
        else:
            ours.add((r["id"], r["epoch"]))
    out: list[A | Locked] = []
    for c in copies:
        key = (c[0], c[1])
        out.append(done.get(key, LOCKED if key in ours else fenced))
    return out


#: The statement that writes each decision of a take.
_CAS = {Decision.TAKE: q.TAKE, Decision.COMPLETE_STOP: q.COMPLETE_STOP}


def _seen(row: asyncpg.Record) -> Seen:
    return Seen(
        observer_id=row["id"],
        status=ObserverStatus(row["status"]),
        dispatch_id=row["dispatch_id"],
        epoch=row["epoch"],
        holder=row["service_id"],
        holder_live=bool(row["holder_live"]),
        holder_lock_free=bool(row["holder_lock_free"]),
        holder_key=row["holder_key"],
        holder_remaining=float(row["holder_remaining"] or 0),
        name=row["name"],
        kind=row["kind"],
        params=json.loads(row["params"]),
        checkpoint=json.loads(row["checkpoint"]) if row["checkpoint"] else None,
        restart_policy=json.loads(row["restart_policy"]) if row["restart_policy"] else None,
        pool=row["pool"],
        kind_version=row["kind_version"],
    )


# ----------------------------------------------------------------------------------- lease
class SessionEnded(DatabaseUnavailable):
    """The lease session is gone: its lock is free, so whatever it proved no longer holds."""


@dataclass(eq=False)
class PgLeaseSession:
    conn: asyncpg.Connection
    lock_key: int
    service_id: uuid.UUID
    row: tuple[object, ...]
    #: Called when the session ends by itself (not when we close it).
    on_end: Callable[[], None]
    #: The process's memory and CPU, reported by each renewal (one for every session).
    usage: Usage
    #: Seconds after which a renewal reads what was directed here and not taken.
    directed_after: float = 1.0
    _closing: bool = False
    #: Seconds the parse of each of its statements may take.
    parse_timeout: float = 5.0
    #: The statements a lease lives by, parsed once when the session opens (see ``prepare``).
    _statements: dict[str, asyncpg.prepared_stmt.PreparedStatement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conn.add_termination_listener(self._terminated)

    async def prepare(self) -> None:
        """Parse the renewal and the read of held copies now, before the lease's clock starts:
        a statement's first run costs a round trip more, and on a slow link (a round trip of a
        second or more) the first renewal then outlasted the deadline its join had set, fencing
        the service at once, again after each rejoin. The join's is parsed by ``prepare_join``
        alone: a session that bridges a blip never joins, and a round trip more there cost a
        service on a slow link its lease."""
        for name, query in (("renew", q.RENEW), ("held", q.HELD_COPIES)):
            self._statements[name] = await self.conn.prepare(query, timeout=self.parse_timeout)

    async def prepare_join(self) -> None:
        with self._errors():
            self._statements["join"] = await self.conn.prepare(q.JOIN, timeout=self.parse_timeout)

    def _terminated(self, _: object) -> None:
        if not self._closing:
            self.on_end()

    @property
    def ended(self) -> bool:
        return bool(self.conn.is_closed())

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            with database_errors():
                yield
        except DatabaseUnavailable as exc:
            if self.conn.is_closed():
                raise SessionEnded(str(exc)) from exc
            raise
        except (
            asyncpg.exceptions.InvalidCachedStatementError,
            asyncpg.exceptions.InvalidSQLStatementNameError,
        ) as exc:
            # A statement parsed when the session opened no longer holds (a migration changed
            # a table it reads; a pooler lost it): the session ends, and the keeper bridges
            # onto a new one, parsed afresh. Raised as it was, it ended the service.
            self.conn.terminate()
            raise SessionEnded(f"the lease's statements must be parsed again: {exc}") from exc

    async def join(self, ttl: float) -> bool:
        """Register (or come back) with this session's lock key; returns draining."""
        if "join" not in self._statements:
            await self.prepare_join()
        with self._errors():
            row = await self._statements["join"].fetchrow(
                self.service_id, *self.row, self.lock_key, ttl
            )
        return bool(row["draining"])

    async def renew(
        self,
        ttl: float,
        timeout: float,
        *,
        stalled: bool = False,
        taking: Collection[uuid.UUID] = (),
    ) -> Renewal | None:
        with self._errors():
            row = await self._statements["renew"].fetchrow(
                self.service_id,
                ttl,
                self.lock_key,
                stalled,
                self.directed_after,
                # As text: a uuid[] parameter costs a type introspection on every new session
                # (a round trip more while it bridges a blip on a slow link).
                ",".join(map(str, taking)),
                *self.usage.read(),
                timeout=timeout,
            )
        if row is None:
            return None
        return Renewal(
            deleting=[uuid.UUID(i) for i in json.loads(row[0])],
            draining=bool(row[1]),
            directed=[
                StartMessage(observer_id=uuid.UUID(o), dispatch_id=uuid.UUID(d))
                for o, d in json.loads(row[2])
            ],
            database_time=row[3],
            timeline=row[4],
        )

    async def held(self, timeout: float) -> set[Copy]:
        with self._errors():
            rows = await self._statements["held"].fetch(self.service_id, timeout=timeout)
        return {Copy(r["id"], r["epoch"]) for r in rows}

    async def close(self, *, deleted: bool) -> None:
        """Leave (graceful stop) and end the session, freeing the lock."""
        self._closing = True
        try:
            with self._errors():
                if deleted:
                    await self.conn.execute(q.LEAVE, self.service_id, timeout=5)
                await self.conn.close(timeout=5)
        except DatabaseUnavailable as exc:
            log.warning("could not close the lease session cleanly: %s", exc)
            self.conn.terminate()

    def terminate(self) -> None:
        self._closing = True
        self.conn.terminate()


class PgLeaseDatabase:
    def __init__(
        self,
        dsn: str,
        *,
        service_id: uuid.UUID,
        name: str,
        worker_count: int,
        host: str,
        version: str,
        connect_timeout: float,
        kinds: dict[str, Any] | None = None,
        pool: str = DEFAULT_POOL,
        directed_after: float = 1.0,
    ) -> None:
        self.dsn = dsn
        self.directed_after = directed_after
        self.service_id = service_id
        #: The row it joins with; its kinds as JSON text (one round trip: no type introspection).
        self._row = (name, worker_count, host, os.getpid(), version, json.dumps(kinds or {}), pool)
        self.connect_timeout = connect_timeout
        #: One for the process: every session's renewals read it on from the last.
        self.usage = Usage(time.monotonic)

    async def connect(self, on_end: Callable[[], None]) -> PgLeaseSession:
        """A new session holding a new advisory lock key for as long as it lives."""
        lock_key = secrets.randbits(63)
        with database_errors():
            conn = await pgconnect.connect(
                self.dsn,
                timeout=self.connect_timeout,
                server_settings={"application_name": f"orch lease {self.service_id}"},
            )
            session = PgLeaseSession(
                conn,
                lock_key,
                self.service_id,
                self._row,
                on_end,
                self.usage,
                self.directed_after,
                parse_timeout=self.connect_timeout,
            )
            try:
                await conn.execute("SELECT pg_advisory_lock($1)", lock_key, timeout=5)
                await session.prepare()
            except BaseException:
                session.terminate()
                raise
        return session
