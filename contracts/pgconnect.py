"""Connecting to one of several PostgreSQL hosts the way libpq does.

asyncpg takes a multi-host DSN, but moves on to the next host only when a host cannot be reached
at all: a host that answers with an error (a standby that is starting up, one that refuses
connections, one that has not yet replayed the database we ask for, too many clients) ends the
whole attempt, so a standby listed before the primary can keep every process off the database.
libpq instead tries the next host whatever the first one said; ``connect`` does the same, one
host at a time, and everything that connects to the orchestrator's database uses it (asyncpg
pools through ``connect=``, SQLAlchemy engines through ``create_engine``). With one host it is
``asyncpg.connect``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

import asyncpg
from asyncpg.exceptions import TargetServerAttributeNotMatched
from sqlalchemy.engine import URL

from orch_contracts import database_url as dburl

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)
#: Seconds a shutdown waits for the connections still in use to come back, before it drops
#: them (asyncpg's own close waits for ever).
CLOSE_TIMEOUT = 5.0

#: What makes a host unusable for this connection (but maybe not the next one).
_NEXT_HOST = (OSError, TimeoutError, asyncpg.PostgresError, TargetServerAttributeNotMatched)


async def connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect``; with several hosts, each in turn until one takes us (and matches
    ``target_session_attrs``). The last host's error is raised when none does."""
    assert dsn is not None, "a DSN is required"
    dsns = dburl.each_host(dsn)
    if len(dsns) < 2:
        return await asyncpg.connect(dsn, **kwargs)
    last: BaseException | None = None
    for one in dsns:
        try:
            return await asyncpg.connect(one, **kwargs)
        except _NEXT_HOST as exc:
            last = exc
    assert last is not None
    raise last


def create_engine(
    url: str | URL, *, connect_args: dict[str, Any] | None = None, **kwargs: Any
) -> AsyncEngine:
    """``create_async_engine`` for the asyncpg driver; with several hosts its connections come
    from ``connect``."""
    # Here, not at the top: a service never makes an engine, and the import costs its start
    # 60 ms.
    from sqlalchemy.ext.asyncio import create_async_engine

    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    canonical = dburl.parse(text)
    if len(dburl.hosts(text)) > 1:
        kwargs["async_creator"] = functools.partial(
            connect, dburl.to_asyncpg(text), **(connect_args or {})
        )
    elif connect_args:
        kwargs["connect_args"] = connect_args
    return create_async_engine(canonical, **kwargs)


async def close_pool(pool: asyncpg.Pool) -> None:
    """Close a pool. A connection some task never gives back is waited for ``CLOSE_TIMEOUT``
    seconds, then dropped: a shutdown must end."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await pool.close()
    except TimeoutError:
        log.warning(
            "database connections still in use %.0f s into the shutdown: dropped", CLOSE_TIMEOUT
        )
        pool.terminate()
    except Exception:  # a lost server: nothing to wait for
        pool.terminate()
