"""What an observer's code sees: its identity, params, last checkpoint and a fenced way out."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from observer_service.errors import LeaseLost

CheckpointFn = Callable[[uuid.UUID, int, Any], Awaitable[None]]


class ObserverContext:
    """Handed to a kind's ``run``. Every await through it checks that this copy still may run."""

    def __init__(
        self,
        *,
        observer_id: uuid.UUID,
        name: str,
        kind: str,
        epoch: int,
        service_id: uuid.UUID,
        params: Any,
        last_checkpoint: Any,
        write_checkpoint: CheckpointFn,
        lease_valid: Callable[[], bool],
    ) -> None:
        self.observer_id = observer_id
        self.name = name
        self.kind = kind
        self.epoch = epoch
        self.service_id = service_id
        #: The params, as the kind's params model (or a dict when it declares none).
        self.params = params
        #: The state saved by the last accepted checkpoint (of any epoch), or None.
        self.last_checkpoint = last_checkpoint
        #: Set when this observer is asked to stop; the task is also cancelled.
        self.stopping = asyncio.Event()
        self.logger = logging.LoggerAdapter(
            logging.getLogger(f"observer.{kind}"),
            {"observer_id": str(observer_id), "epoch": epoch},
        )
        self._write_checkpoint = write_checkpoint
        self._lease_valid = lease_valid

    def ensure_alive(self) -> None:
        """Raise LeaseLost when this service can no longer be sure it still holds the observer.

        Call it right before a side effect the orchestrator cannot fence (sending an order,
        writing a file): it narrows the window for a stale copy to the code that follows it.
        """
        if self.stopping.is_set():
            raise asyncio.CancelledError()
        if not self._lease_valid():
            raise LeaseLost("service lease is no longer valid")

    async def checkpoint(self, state: Any) -> None:
        """Save JSON ``state``; a stale epoch raises Fenced and this copy stops at once."""
        self.ensure_alive()
        await self._write_checkpoint(self.observer_id, self.epoch, state)
        self.last_checkpoint = state

    async def sleep(self, seconds: float) -> None:
        """Sleep, woken by cancellation; afterwards, check that this copy still may run."""
        await asyncio.sleep(seconds)
        self.ensure_alive()
