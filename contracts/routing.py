"""Where a broker message goes, as a typed value, and the one function that sends a start.

Both sides publish through ``Sender``: the manager's outbox stores a ``Destination`` with each
message, the services use it to hand observers on. Neither spells a routing key.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import aio_pika
from aio_pika.abc import AbstractChannel
from aio_pika.exceptions import DeliveryError, PublishError

from orch_contracts import tracing
from orch_contracts.errors import BrokerUnavailable, Unroutable, broker_errors
from orch_contracts.messages import DirectedStart, Message, StartMessage
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.topology import Topology

log = logging.getLogger(__name__)


class Route(StrEnum):
    #: A pool's work queue: start messages, taken by whichever service of the pool has a free
    #: slot.
    WORK = "work"
    #: The control fanout exchange: every live service (cancel, drain).
    BROADCAST = "broadcast"
    #: One service's own control queue (directed start, handoff).
    SERVICE = "service"
    #: The dead-letter exchange, whose queue keeps what could not run.
    ERRORS = "errors"


@dataclass(frozen=True)
class Destination:
    route: Route
    service_id: uuid.UUID | None = None
    #: Of a start: the observer's pool, whose work queue takes it (also when a directed start
    #: comes back).
    pool: str = DEFAULT_POOL

    def __post_init__(self) -> None:
        if (self.route is Route.SERVICE) != (self.service_id is not None):
            raise ValueError("a service id goes with Route.SERVICE, and only with it")

    @classmethod
    def service(cls, service_id: uuid.UUID, pool: str = DEFAULT_POOL) -> Destination:
        return cls(Route.SERVICE, service_id, pool)

    @classmethod
    def work(cls, pool: str) -> Destination:
        return cls(Route.WORK, pool=pool)


WORK = Destination(Route.WORK)
BROADCAST = Destination(Route.BROADCAST)
ERRORS = Destination(Route.ERRORS)


class Sender:
    """Publishes on one channel that has publisher confirms and raises on returns."""

    def __init__(self, channel: AbstractChannel, topology: Topology) -> None:
        self.channel = channel
        self.topology = topology

    async def publish(self, to: Destination, message: Message, *, timeout: float = 10) -> bool:
        """Publish and wait for the broker's confirm. False when it was returned: the service it
        was sent to has no control queue (any more). Raises BrokerUnavailable, Unroutable for a
        start returned by the work queue (deleted): it was not delivered, so it is kept. The
        current span's trace context goes along in the headers (``orch_contracts.tracing``)."""
        body = aio_pika.Message(
            message.to_bytes(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers=cast(dict[str, Any] | None, tracing.carrier()),
        )
        with broker_errors():
            if to.route is Route.WORK:
                queue = self.topology.work_queue_of(to.pool)
                try:
                    await self.channel.default_exchange.publish(
                        body, routing_key=queue, mandatory=True, timeout=timeout
                    )
                except PublishError as exc:  # basic.return: no such queue (any more, or yet)
                    raise Unroutable(f"{queue} returned a start", pool=to.pool) from exc
                except DeliveryError as exc:  # basic.nack
                    raise BrokerUnavailable(f"{queue} refused a start") from exc
            elif to.route is Route.SERVICE:
                assert to.service_id is not None
                try:
                    await self.channel.default_exchange.publish(
                        body,
                        routing_key=self.topology.control_queue(to.service_id),
                        mandatory=True,
                        timeout=timeout,
                    )
                except DeliveryError:
                    return False
            else:
                name = (
                    self.topology.control_exchange
                    if to.route is Route.BROADCAST
                    else self.topology.dead_letter_exchange
                )
                exchange = await self.channel.get_exchange(name, ensure=False)
                await exchange.publish(body, routing_key="", timeout=timeout)
        return True

    async def send(
        self, to: Destination, message: Message, *, timeout: float = 10
    ) -> Destination | None:
        """Publish; a directed start that comes back goes to the work queue instead. Returns
        where the message went (None: returned, and nothing else to do with it)."""
        if await self.publish(to, message, timeout=timeout):
            return to
        if isinstance(message, DirectedStart):
            log.info("service %s has no control queue; start sent to the work queue", to.service_id)
            work = Destination.work(to.pool)
            await self.publish(work, message.start(), timeout=timeout)
            return work
        log.info(
            "service %s has no control queue; %s dropped", to.service_id, type(message).__name__
        )
        return None

    async def send_start(
        self, start: StartMessage, on: uuid.UUID | None = None, *, pool: str = DEFAULT_POOL
    ) -> Destination | None:
        """Start an observer of ``pool`` on service ``on`` (directed), else through the pool's
        work queue."""
        if on is None:
            return await self.send(Destination.work(pool), start)
        return await self.send(Destination.service(on, pool), DirectedStart.of(start))
