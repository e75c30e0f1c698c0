"""What an observer's code sees: its identity, params, last checkpoint and a fenced way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from orch_contracts import aio
from orch_contracts.errors import LeaseLost
from orch_contracts.logs import observer_log


class ObserverContext:
    """Handed to a kind's ``run``. Every await of the kind's own coroutine is checked against
    the service's lease before it resumes, so the kind never goes on after others took it."""

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
        save: Callable[[Any], Awaitable[None]],
        alive: Callable[[], bool],
        logger: logging.LoggerAdapter[logging.Logger] | None = None,
        witness: Callable[[str], None] | None = None,
        emit: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        self.observer_id = observer_id
        self.name = name
        self.kind = kind
        #: The fencing token of this copy: give it to external systems that can refuse writes
        #: carrying an older one.
        self.epoch = epoch
        self.service_id = service_id
        #: The params, as the kind's params model (or a dict when it declares none).
        self.params = params
        #: The state saved by the last accepted checkpoint (of any epoch), or None.
        self.last_checkpoint = last_checkpoint
        #: Set when this observer is asked to stop; the task is also cancelled.
        self.stopping = aio.Event()
        #: Every line names this observer and this copy.
        self.logger = logger or observer_log(
            f"observer.{kind}", observer_id=observer_id, name=name, kind=kind, epoch=epoch
        )
        self._save = save
        self._alive = alive
        self._witness = witness
        self._emit = emit
        self._on_abandon: list[Callable[[], object]] = []

    def on_abandon(self, release: Callable[[], object]) -> Callable[[], None]:
        """Have ``release`` called if this copy is abandoned: its lease was lost, so none of
        its code runs again, its ``finally`` blocks included. ``release`` must only free what
        the copy holds in this process, synchronously, without acting as the observer: abort a
        socket, say, whose library would otherwise keep the connection alive on its own tasks
        (a websocket's pings) beside the copy that took over. Returns a function that takes it
        back (call it when the resource is closed the ordinary way)."""
        self._on_abandon.append(release)

        def forget() -> None:
            with contextlib.suppress(ValueError):
                self._on_abandon.remove(release)

        return forget

    def abandoned(self) -> None:
        """This copy was abandoned (``guard``): release what it registered, newest first."""
        hooks, self._on_abandon = self._on_abandon, []
        for release in reversed(hooks):
            try:
                release()
            except Exception:  # a resource of a copy nobody runs: logged, never raised
                self.logger.exception("releasing what an abandoned copy held failed")

    def witness(self, event: str) -> None:
        """Say that a side effect follows (``event`` names it), from any thread. Under
        ``orch verify`` it is recorded with this copy's identity, outside the fenced path, so a
        side effect made by a copy that should no longer run shows as an overlap; elsewhere it
        does nothing."""
        if self._witness is not None:
            self._witness(event)

    def ensure_alive(self) -> None:
        """Raise LeaseLost when this service can no longer be sure it still holds the observer.

        Call it right before a side effect the orchestrator cannot fence (sending an order,
        writing a file). Awaits after it are guarded too; what remains unguarded is the
        synchronous code between this call and the side effect.
        """
        if self.stopping.is_set():
            raise asyncio.CancelledError()
        if not self._alive():
            raise LeaseLost("service lease is no longer valid")

    async def emit(self, record: Any) -> None:
        """Stage ``record`` (JSON: a dict, a list, text, a number) as an output of this
        observer. Staged records are committed with the next ``checkpoint`` (or on their own,
        for a kind declared with ``commit_every``), then published on ``<prefix>.outputs``
        with their ``seq`` (``docs/outputs.md``). A copy that stops or is fenced before the
        commit never delivers them: they go with the checkpoint it never wrote. Waits while
        this copy has too many records staged or not yet confirmed by the broker."""
        if self._emit is None:
            raise RuntimeError("this context cannot emit")
        await self._emit(record)

    async def checkpoint(self, state: Any) -> None:
        """Save JSON ``state`` and commit every record emitted since the last commit, in one
        write; a stale epoch raises Fenced and this copy stops at once. While the
        orchestrator's database is unavailable it waits (the lease decides how long)."""
        self.ensure_alive()
        await self._save(state)
        self.last_checkpoint = state

    async def sleep(self, seconds: float) -> None:
        """Sleep, woken by cancellation; afterwards, check that this copy still may run.
        ``seconds`` below 0, or NaN, raises ValueError, as ``time.sleep`` does: an interval
        gone wrong is the kind's error (restarted with backoff, then failed), never a loop
        that polls as fast as it can. 0 is one turn of the event loop."""
        await asyncio.sleep(checked_delay(seconds))
        self.ensure_alive()


def checked_delay(seconds: float) -> float:
    """``seconds`` if ``ctx.sleep`` may wait that long; ValueError naming it otherwise."""
    if not seconds >= 0:  # NaN compares false too
        raise ValueError(f"ctx.sleep({seconds!r}): the seconds must be 0 or more")
    return seconds
