"""One running observer: its kind's code under the restart policy, and why it stopped."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from aio_pika.abc import AbstractIncomingMessage
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from contracts.kinds import KindSpec, RestartPolicy
from observer_service.context import ObserverContext
from observer_service.store import Taken


class StopReason(Enum):
    DELETE = "deleted"
    SHUTDOWN = "service stopping"
    HANDOFF = "handed off"
    LEASE_LOST = "lease lost"
    CHANNEL_LOST = "broker channel lost"


class ObserverReturned(Exception):
    """An observer is meant to run until stopped; returning is treated as an error."""


@dataclass(eq=False)
class Runner:
    taken: Taken
    spec: KindSpec
    ctx: ObserverContext
    #: The unacked start message behind this copy; None for a directed start.
    message: AbstractIncomingMessage | None
    #: The broker session that delivered ``message`` (None for a directed start).
    generation: int | None
    task: asyncio.Task[str] | None = None
    stop_reason: StopReason | None = None
    #: For a handoff: the service that should take it next (None: any, via the work queue).
    handoff_to: uuid.UUID | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def observer_id(self) -> uuid.UUID:
        return self.taken.observer_id

    @property
    def epoch(self) -> int:
        return self.taken.epoch

    def stop(self, reason: StopReason) -> None:
        """Ask the observer to stop now; the first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.ctx.stopping.set()
        if self.task is not None:
            self.task.cancel()


def effective_policy(spec: KindSpec, override: dict[str, object] | None) -> RestartPolicy:
    if not override:
        return spec.restart_policy
    return RestartPolicy.model_validate({**spec.restart_policy.model_dump(), **override})


async def run_with_restarts(
    spec: KindSpec,
    ctx: ObserverContext,
    policy: RestartPolicy,
    on_restart: Callable[[str, float], Awaitable[None]],
) -> str:
    """Run the kind, restarting it in place after an error with exponential backoff and jitter.

    Returns the last error once ``policy.max_restarts`` restarts are used up. Cancellation,
    Fenced and LeaseLost are BaseExceptions: they pass straight through, never retried.
    """

    async def before_sleep(state: RetryCallState) -> None:
        assert state.outcome is not None
        assert state.next_action is not None
        await on_restart(_describe(state.outcome.exception()), state.next_action.sleep)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.max_restarts + 1),
        wait=wait_exponential(multiplier=policy.base_delay, max=policy.max_delay)
        + wait_random(0, policy.base_delay),
        retry=retry_if_exception_type(Exception),
        before_sleep=before_sleep,
        sleep=ctx.sleep,
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                await spec.run(ctx)
                raise ObserverReturned("run() returned; an observer must run until stopped")
    except Exception as exc:
        return _describe(exc)
    raise AssertionError("unreachable")  # pragma: no cover


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]
