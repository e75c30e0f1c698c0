"""A control message is acted on only when the database agrees.

Anyone who may publish on the broker can put a drain, a cancel or a handoff on the control
exchange, and a body proves nothing. The manager writes what a control message means before
it publishes it (the outbox publishes only after its commit), so a real message always finds
its row saying so:

- a drain finds this service's row draining, an undrain finds it not draining;
- a cancel finds its copy's row being stopped (on_deleting, pausing) or no longer that copy's
  (deleted, paused, failed, released, taken by another service or at another epoch);
- a handoff finds the very move recorded on its copy's row (``observers.handoff_to``, written
  with the message: by the leader for a move, by the manager for a restart, to the holder
  itself).

A directed start needs no check: its take is the compare-and-set that decides (``take.py``).

Each check is one read by key, batched with the checks that arrive together, and bounded in
time. One the database cannot answer is asked again until it can, or until there is nothing
left to act on (the copy stopped for another reason): never acted on blindly, never dropped.
The lease renewal backs cancels and drains up anyway (``Renewal``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

from observer_service.ports import ControlFacts, Copy, Holding, Store
from orch_contracts.backoff import Backoff
from orch_contracts.batching import LINGER, Batcher
from orch_contracts.errors import Transient
from orch_contracts.statuses import LIVE, ObserverStatus

log = logging.getLogger(__name__)

#: How long one check may take, seconds; then it is asked again.
CHECK_TIMEOUT = 2.0


def cancel_confirmed(row: Holding | None, me: uuid.UUID, copy: Copy | None) -> bool:
    """The row says stop: it is being stopped or has ended, or (for a running ``copy``) it is
    no longer that copy's. Without a copy (its start still being admitted) only a row that is
    being stopped or has ended says so."""
    if row is None or row.status not in LIVE:
        return True
    if copy is None:
        return False
    return (row.holder, row.epoch) != (me, copy.epoch)


def handoff_confirmed(row: Holding | None, me: uuid.UUID, copy: Copy, to: uuid.UUID) -> bool:
    """The leader recorded this move for this copy."""
    return (
        row is not None
        and row.status is ObserverStatus.PROCESSING
        and (row.holder, row.epoch) == (me, copy.epoch)
        and row.handoff_to == to
    )


class ControlChecks:
    """What the database says when control messages arrive: one statement for the checks
    that arrive together (a supervised side task runs ``reads``)."""

    def __init__(self, store: Store, *, timeout: float = CHECK_TIMEOUT) -> None:
        self.store = store
        self.timeout = timeout
        self.reads: Batcher[tuple[uuid.UUID, ...], ControlFacts] = Batcher(
            self._read, linger=LINGER
        )

    async def _read(self, asks: list[tuple[uuid.UUID, ...]]) -> list[ControlFacts]:
        ids = sorted({i for ask in asks for i in ask})
        facts = await asyncio.wait_for(self.store.control_facts(ids), self.timeout)
        return [facts] * len(asks)

    async def facts(
        self, observer_ids: Sequence[uuid.UUID], *, moot: Callable[[], bool]
    ) -> ControlFacts | None:
        """The database's answer, asked again while it cannot give one; None once ``moot()``
        (nothing left to act on)."""
        backoff = Backoff(0.05, 2.0, jitter=0.2)
        tries = 0
        while True:
            try:
                return await self.reads.submit(tuple(observer_ids))
            except (Transient, TimeoutError) as exc:
                tries += 1
                if tries in (1, 10) or tries % 100 == 0:
                    log.warning(
                        "checking a control message: %s; asking again (attempt %d)",
                        str(exc) or type(exc).__name__,
                        tries,
                    )
            if moot():
                return None
            await asyncio.sleep(backoff.next())
