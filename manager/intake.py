"""Group commit for single creates: concurrent ``POST /observers`` requests of one manager process
share one statement (rows, history and outbox records) and one confirmed publish.

No request waits for company. A create that finds nothing in flight is written at once, alone;
the creates that arrive while a write is in flight form the next write, started the moment the
one before it has committed (``orch_contracts.batching.Batcher``). Under load a write therefore
carries what arrived during the last one, the way PostgreSQL groups commits, and a lone client
pays no window at all.

Each request still gets its own answer: its row, or its own error (a name taken, by an earlier
observer or by another create of the same write, is that request's 409 alone). An error of the
write itself (the database unavailable) is every waiting request's error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orch_contracts import tracing
from orch_contracts.batching import LINGER, Batcher
from orch_contracts.errors import NameTaken
from orch_manager import repository as repo
from orch_manager.outbox import Pending

#: Writes rows for a batch of creates: each row in order, or NameTaken (None: without saying
#: who has it) where the name was taken.
Write = Callable[
    [Sequence[repo.NewObserver]],
    Awaitable[tuple[Sequence[dict[str, Any] | NameTaken | None], list[Pending]]],
]
#: Publishes what a write committed (never raises for an unavailable broker).
Publish = Callable[[Sequence[Pending]], Awaitable[None]]


class GroupCommit:
    """Creates written together; ``run()`` is a supervised task of the manager's runtime."""

    def __init__(self, write: Write, publish: Publish, *, most: int = 1000) -> None:
        self._write = write
        self._publish = publish
        self._batcher: Batcher[repo.NewObserver, dict[str, Any] | NameTaken] = Batcher(
            self._one_write, max_batch=most, linger=LINGER
        )
        #: Writes made and creates they carried (the mean batch size, for the benchmark).
        self.writes = 0
        self.creates = 0

    async def run(self) -> None:
        await self._batcher.run()

    async def create(self, new: repo.NewObserver) -> dict[str, Any]:
        """The row made for ``new`` once it is committed and its start published (or left to
        the outbox relay); raises NameTaken, or the write's own error."""
        row = await self._batcher.submit(new)
        if isinstance(row, NameTaken):
            raise row
        return row

    async def _one_write(self, batch: list[repo.NewObserver]) -> list[dict[str, Any] | NameTaken]:
        # A name twice in one write: the first create of it stands, the others are taken.
        # (or two names that look alike: the same key)
        first: dict[str, int] = {}
        for i, new in enumerate(batch):
            first.setdefault(new.key, i)
        todo = sorted(first.values())
        began = tracing.now()
        rows, pending = await self._write([batch[i] for i in todo])
        if began:  # the write, in the trace of each create it carried
            ended = tracing.now()
            for new in batch:
                tracing.record(
                    "group commit",
                    parent=new.trace,
                    started=began,
                    ended=ended,
                    attributes={"orch.creates": len(batch)},
                )
        self.writes += 1
        self.creates += len(batch)
        await self._publish(pending)
        made = dict(zip(todo, rows, strict=True))
        return [_result(made[first[new.key]], batch[first[new.key]], new) for new in batch]


def _result(
    row: dict[str, Any] | NameTaken | None, first: repo.NewObserver, new: repo.NewObserver
) -> dict[str, Any] | NameTaken:
    """What ``new`` gets, ``first`` being the create of its name (its key) that was written
    and ``row`` what that write gave."""
    if row is None:  # taken, the writer does not say by whom
        return NameTaken(first.name)
    if isinstance(row, NameTaken) or new is first:
        return row  # the observer that holds it, for each create of that name
    return NameTaken(first.name, alike=first.name != new.name)  # by ``first``, just now
