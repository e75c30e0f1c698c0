"""Group commit for single creates: concurrent ``POST /observers`` requests of one manager process
share one statement (rows, history and outbox records) and one confirmed publish.

No request waits for company. A create that finds nothing in flight is written at once, alone;
the creates that arrive while a write is in flight form the next write, started the moment the
one before it has committed. Under load a write therefore carries what arrived during the last
one (the way PostgreSQL groups commits), and a lone client pays no window at all.

Each request still gets its own answer: its row, or its own error (a name taken, by an earlier
observer or by another create of the same write, is that request's 409 alone). An error of the
write itself (the database unavailable) is every waiting request's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.errors import NameTaken
from manager import repository as repo
from manager.outbox import Pending

#: Writes rows for a batch of creates: each row in order, or None where the name was taken.
Write = Callable[
    [Sequence[repo.NewObserver]], Awaitable[tuple[list[dict[str, Any] | None], list[Pending]]]
]
#: Publishes what a write committed (never raises for an unavailable broker).
Publish = Callable[[Sequence[Pending]], Awaitable[None]]


@dataclass
class _Create:
    new: repo.NewObserver
    answer: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GroupCommit:
    """One writer at a time; whatever queues behind it goes in its next write."""

    def __init__(self, write: Write, publish: Publish, *, most: int = 1000) -> None:
        self._write = write
        self._publish = publish
        #: The most creates one write carries (the batch route's own limit).
        self.most = most
        self._queue: list[_Create] = []
        self._writer: asyncio.Task[None] | None = None
        #: Writes made and creates they carried (the mean batch size, for the benchmark).
        self.writes = 0
        self.creates = 0

    async def create(self, new: repo.NewObserver) -> dict[str, Any]:
        """The row made for ``new`` once it is committed and its start published (or left to
        the outbox relay); raises NameTaken, or the write's own error."""
        item = _Create(new)
        self._queue.append(item)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain(), name="group-commit")
        # A request cancelled (its client gone) leaves its create to the write it is in.
        return await asyncio.shield(item.answer)

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.most], self._queue[self.most :]
            await self._one_write(batch)

    async def _one_write(self, batch: list[_Create]) -> None:
        # A name twice in one write: the first create of it stands, the others are taken.
        first: dict[str, _Create] = {}
        for item in batch:
            first.setdefault(item.new.name, item)
        todo = list(first.values())
        try:
            rows, pending = await self._write([item.new for item in todo])
        except Exception as exc:
            for item in batch:
                _settle(item, error=exc)
            return
        self.writes += 1
        self.creates += len(batch)
        try:
            await self._publish(pending)
        finally:
            made = {id(item): row for item, row in zip(todo, rows, strict=True)}
            for item in batch:
                row = made.get(id(item))
                if row is None:
                    _settle(item, error=NameTaken(item.new.name))
                else:
                    _settle(item, row=row)


def _settle(
    item: _Create, *, row: dict[str, Any] | None = None, error: BaseException | None = None
) -> None:
    if item.answer.done():
        return
    if error is not None:
        item.answer.set_exception(error)
    else:
        assert row is not None
        item.answer.set_result(row)
