"""How the service retries its own writes while its database is unavailable.

A write the orchestrator makes for a running copy (a checkpoint, a restart record) is retried
for as long as the lease is still surely ours, also when its row is locked by another
transaction (``RowLocked``, never taken for a fence); after that it no longer matters (others
may hold the observer) and the copy stops with LeaseLost. A write that settles a stopped copy
is retried until it lands: an observer must never stay held by a service that does not run it.
Neither kind of failure ever reaches kind code as an ``Exception``, nor counts as its error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
    wait_random,
)

from observer_service.ports import Locked
from orch_contracts.errors import DatabaseUnavailable, LeaseLost, RowLocked, Transient

log = logging.getLogger(__name__)
T = TypeVar("T")


def landed(result: T | Locked) -> T:
    """A batch's answer for one item, or RowLocked where the batch skipped its row as locked:
    the loops below then retry it alone, as they retry an outage."""
    if isinstance(result, Locked):
        raise RowLocked("its row is locked by another transaction")
    return result


async def _retried(
    op: Callable[[], Awaitable[T]],
    failure: type[BaseException],
    retrying: Callable[[], AsyncRetrying],
) -> T:
    """``op()`` once as it is; only after a ``failure`` the retry loop ``retrying()`` makes.
    Every take and checkpoint of every observer passes here: building tenacity's machinery for
    each of them cost a quarter of a service's CPU in bulk intake, for a case (the database
    away) that almost never holds."""
    try:
        return await op()
    except failure:
        pass
    async for attempt in retrying():
        with attempt:
            return await op()
    raise AssertionError("unreachable")  # pragma: no cover


async def while_leased(op: Callable[[], Awaitable[T]], alive: Callable[[], bool]) -> T:
    """``op()``, retried while the database is unavailable and ``alive()`` holds."""

    def retrying() -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(DatabaseUnavailable),
            wait=wait_exponential(multiplier=0.02, max=0.5) + wait_random(0, 0.02),
            stop=lambda _: not alive(),
            reraise=True,
        )

    try:
        return await _retried(op, DatabaseUnavailable, retrying)
    except DatabaseUnavailable as exc:
        raise LeaseLost(f"database unavailable until the lease ran out: {exc}") from exc


async def until_done(op: Callable[[], Awaitable[T]], what: str) -> T:
    """``op()``, retried while a server is unavailable, for as long as it takes."""

    def report(state: RetryCallState) -> None:
        if state.attempt_number in (1, 10) or state.attempt_number % 100 == 0:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s: %s; retrying (attempt %d)", what, exc, state.attempt_number)

    def retrying() -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(Transient),
            wait=wait_exponential(multiplier=0.02, max=2.0) + wait_random(0, 0.02),
            stop=stop_never,
            before_sleep=report,
            reraise=True,
        )

    return await _retried(op, Transient, retrying)
