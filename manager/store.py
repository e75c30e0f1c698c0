"""The manager's data room: its connections to PostgreSQL and the one way a statement runs.

Every statement is in ``orch_manager.queries`` (named ``:params``); ``orch_manager.repository``
holds the units of work made of them, and runs them here, on a ``Tx``. Nothing else in the
manager talks to the database. Statements go straight to asyncpg as prepared statements (cached
per connection): no ORM, no SQL compilation per request, no reset round trip when a connection
goes back.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import orjson

from orch_contracts import pgconnect, tracing
from orch_contracts.errors import database_errors
from orch_contracts.settings import CommonSettings

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@functools.cache
def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its ``:name`` params numbered as PostgreSQL takes them (one number per
    name, however often it occurs), and the names in that order. ``::type`` casts stay."""
    names: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        return f"${names.setdefault(m.group(1), len(names) + 1)}"

    return _NAMED.sub(number, sql), tuple(names)


class Row(asyncpg.Record):  # type: ignore[misc]
    """A result row: by name (``row["status"]``), as an attribute (``row.status``), or as a
    dict (``dict(row)``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tx:
    """One connection of the store: in a transaction, or committing each statement alone.
    Driver errors are converted by the store's context that handed it out."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    @staticmethod
    def _args(sql: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
        text, names = positional(sql)
        return text, [params[n] for n in names]

    async def rows(self, sql: str, **params: Any) -> list[Row]:
        text, args = self._args(sql, params)
        rows: list[Row] = await self._conn.fetch(text, *args)
        return rows

    async def row(self, sql: str, **params: Any) -> Row | None:
        text, args = self._args(sql, params)
        row: Row | None = await self._conn.fetchrow(text, *args)
        return row

    async def value(self, sql: str, **params: Any) -> Any:
        text, args = self._args(sql, params)
        return await self._conn.fetchval(text, *args)

    async def execute(self, sql: str) -> None:
        """A statement without parameters, in the simple protocol (``VACUUM``, say)."""
        await self._conn.execute(sql)

    async def values(self, sql: str, **params: Any) -> list[Any]:
        """The first column of every row."""
        return [r[0] for r in await self.rows(sql, **params)]

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """A nested transaction: what fails inside is undone alone."""
        async with self._conn.transaction():
            yield


#: Attributes of its spans (``orch_contracts.tracing``).
_DB = {"db.system": "postgresql"}


def _json_text(value: str) -> str:
    return value  # the manager writes JSON it has already encoded (``repository.to_json``)


#: The largest integer a JSON number may be and keep its value everywhere (a double's
#: integers, JavaScript's too): the API refuses larger ones (``schemas.clean_params``).
MAX_EXACT_INT = 2**53


def _number_int(text: str) -> int | str:
    value = int(text) if len(text) <= 20 else None
    return value if value is not None and abs(value) <= MAX_EXACT_INT else text


def _number_float(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def _json_value(text: str) -> Any:
    """A JSON column's value. A number no double holds (a row an earlier release stored with a
    400-digit integer) comes back as its digits, a string, and JSON nested past what a reader
    follows as its text: the row stays readable, listable and deletable."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            return json.loads(text, parse_int=_number_int, parse_float=_number_float)
        except (ValueError, RecursionError):
            return text


async def _prepare(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name, schema="pg_catalog", encoder=_json_text, decoder=_json_value, format="text"
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset, a no-op: the manager's statements leave no session state behind (no
    LISTEN, cursor, session lock or setting; its advisory locks end with their transaction)."""


class ManagerStore:
    """The manager's pool of connections. ``open`` before use, ``close`` at the end."""

    def __init__(self, settings: CommonSettings, *, pool_size: int = 20) -> None:
        self._dsn = settings.asyncpg_dsn
        self._size = pool_size
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        """Create the pool; connections open as they are needed. The database need not be up."""
        self._pool = asyncpg.create_pool(
            self._dsn,
            connect=pgconnect.connect,  # several hosts: each in turn, as libpq tries them
            min_size=0,
            max_size=self._size,
            max_inactive_connection_lifetime=3600,
            init=_prepare,
            reset=_keep_session,
            record_class=Row,
            timeout=5,
            command_timeout=30,
        )
        await self._pool  # min_size 0: opens nothing

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pgconnect.close_pool(pool)

    def fenced(self, fence: Callable[[Tx], Awaitable[None]]) -> ManagerStore:
        """This pool, with every transaction begun by ``fence`` (the leader's loops begin
        theirs by holding the lease: ``repository.leader_fence``)."""
        return FencedStore(self, fence)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        assert self._pool is not None, "the store is not open"
        with database_errors():
            async with self._pool.acquire(timeout=30) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """A transaction: committed when the block ends, rolled back when it raises."""
        with tracing.child("transaction", _DB):
            async with self._connection() as conn, conn.transaction():
                yield Tx(conn)

    @contextlib.asynccontextmanager
    async def autocommit(self) -> AsyncIterator[Tx]:
        """A connection without BEGIN/COMMIT round trips: for reads, and for work done in one
        (atomic) statement."""
        with tracing.child("statement", _DB):
            async with self._connection() as conn:
                yield Tx(conn)


class FencedStore(ManagerStore):
    """A view of a store whose transactions each begin with a fence; its autocommit
    statements (reads, and writes that are whole in one statement) are not fenced."""

    def __init__(self, store: ManagerStore, fence: Callable[[Tx], Awaitable[None]]) -> None:
        self._store = store
        self._fence = fence

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._store._connection() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with super().transaction() as tx:
            await self._fence(tx)
            yield tx
