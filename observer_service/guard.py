"""Kind code never resumes on a lease that may be gone.

A copy frozen between ``ctx.ensure_alive()`` and its side effect, while it awaits something (a
pool, a connect, a DNS lookup), would otherwise wake up and perform that side effect although
others took the observer meanwhile. ``guarded`` drives the kind's coroutine itself and checks the
lease before every resumption:

- lease lost: ``LeaseLost`` is thrown into the kind at the await it was suspended in;
- lease not confirmed for a while (this process may have been paused): the kind waits until
  the next renewal on the same database session proves nothing was taken, then goes on.

What this cannot cover: synchronous code between the last check and the side effect, and tasks
or threads that a kind starts itself (they are not driven through here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")

#: Before kind code resumes: None to go on, a future to wait for first (then ask again), or
#: raise LeaseLost.
Gate = Callable[[], "asyncio.Future[None] | None"]


class _Guarded:
    def __init__(self, coro: Coroutine[Any, Any, Any], gate: Gate) -> None:
        self._coro = coro
        self._gate = gate

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, gate = self._coro, self._gate
        value: Any = None
        error: BaseException | None = None
        while True:
            if error is None:  # about to resume kind code: the lease first
                try:
                    while (parked := gate()) is not None:
                        yield from parked.__await__()
                except BaseException as exc:  # LeaseLost, or cancelled while parked
                    error = exc
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # thrown in by the task (a cancellation): goes in as is
                error = exc


def guarded(coro: Coroutine[Any, Any, T], gate: Gate) -> Any:
    """Await ``coro`` with ``gate`` consulted before each of its resumptions."""
    return _Guarded(coro, gate)
