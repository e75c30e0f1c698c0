"""asyncio pieces sized for one per observer."""

from __future__ import annotations

import asyncio
from typing import Literal


class Event:
    """``asyncio.Event``, less its memory: the list of waiters exists only while one waits.
    The standard one allocates a deque up front (about 760 bytes); a running observer kept four
    (its stop, its runner's end, its outputs' room and pending), 3 KiB of each observer's 13."""

    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[bool]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if self._value:
            return
        self._value = True
        for waiter in self._waiters or ():
            if not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> Literal[True]:
        if self._value:
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            self._waiters.remove(waiter)
            if not self._waiters:
                self._waiters = None
