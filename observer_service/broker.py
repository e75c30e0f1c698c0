"""One AMQP session of a service: a connection, a work channel, a control channel.

A session is never repaired in place: when anything in it closes, the service stops the
observers delivered on it (their deliveries are gone) and opens a new session.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from aio_pika.exceptions import DeliveryError

from contracts.messages import DirectedStart, StartMessage
from contracts.settings import CommonSettings
from contracts.topology import Topology, broker_version, declare_topology

log = logging.getLogger(__name__)
_generations = itertools.count(1)

OnMessage = Callable[[AbstractIncomingMessage, int], Awaitable[None]]


class BrokerSession:
    def __init__(self) -> None:
        self.generation = next(_generations)
        self.closed = asyncio.Event()
        self.connection: AbstractConnection | None = None
        self._work_queue: AbstractQueue | None = None
        self._work_tag: str | None = None
        self._control_channel: AbstractChannel | None = None
        self._topology: Topology | None = None
        self.version: tuple[int, ...] = (0,)

    @property
    def is_open(self) -> bool:
        return not self.closed.is_set()

    def _on_close(self, *_: Any) -> None:
        if not self.closed.is_set():
            log.warning("broker session %d closed", self.generation)
            self.closed.set()

    async def open(
        self,
        settings: CommonSettings,
        *,
        service_id: uuid.UUID,
        prefetch: int,
        on_start: OnMessage,
        on_control: OnMessage,
        consume_work: bool = True,
    ) -> None:
        topo = settings.topology
        self.connection = await aio_pika.connect(
            settings.amqp_url_with_heartbeat,
            timeout=10,
            client_properties={"connection_name": f"{topo.prefix} observer-service {service_id}"},
        )
        self.connection.close_callbacks.add(self._on_close)
        self.version = broker_version(self.connection)
        work = await self.connection.channel(publisher_confirms=False)
        work.close_callbacks.add(self._on_close)
        await work.set_qos(prefetch_count=prefetch)
        queue = await declare_topology(
            work,
            topo,
            version=self.version,
            queue_type=settings.queue_type,
            consumer_timeout_ms=settings.consumer_timeout_ms,
        )
        # Confirms and returns: a directed start to a queue that does not exist (yet, or any
        # more) must come back to us rather than vanish.
        control = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        control.close_callbacks.add(self._on_close)
        exchange = await control.get_exchange(topo.control_exchange)
        cq = await control.declare_queue(
            topo.control_queue(service_id), exclusive=True, auto_delete=True
        )
        await cq.bind(exchange)
        gen = self.generation
        await cq.consume(lambda m: on_control(m, gen), no_ack=True)
        self._work_queue = queue
        self._control_channel, self._topology = control, topo
        if consume_work:
            self._work_tag = await queue.consume(lambda m: on_start(m, gen))

    async def publish(
        self,
        start: StartMessage,
        *,
        to_errors: bool = False,
        to_service: uuid.UUID | None = None,
    ) -> None:
        """Publish a start: to the work queue, the dead-letter exchange, or (directed) to one
        service's control queue, falling back to the work queue if that queue does not exist."""
        if self._control_channel is None or self._topology is None or not self.is_open:
            raise ConnectionError("broker session is not open")
        channel, topology = self._control_channel, self._topology

        def message(body: bytes) -> aio_pika.Message:
            return aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )

        if to_errors:
            dlx = await channel.get_exchange(topology.dead_letter_exchange)
            await dlx.publish(message(start.to_bytes()), routing_key="")
            return
        if to_service is not None:
            directed = DirectedStart(observer_id=start.observer_id, dispatch_id=start.dispatch_id)
            try:
                await channel.default_exchange.publish(
                    message(directed.to_bytes()),
                    routing_key=topology.control_queue(to_service),
                    mandatory=True,
                )
                return
            except DeliveryError:
                log.info("service %s has no control queue; sent to the work queue", to_service)
        await channel.default_exchange.publish(
            message(start.to_bytes()), routing_key=topology.work_queue
        )

    async def stop_consuming(self) -> None:
        """Take no more start messages (those already delivered stay ours to settle)."""
        if self._work_queue is not None and self._work_tag is not None and self.is_open:
            tag, self._work_tag = self._work_tag, None
            try:
                await self._work_queue.cancel(tag, timeout=5)
            except Exception as exc:
                log.warning("could not cancel the work consumer: %s", exc)

    async def close(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            try:
                await self.connection.close()
            except Exception as exc:
                log.warning("broker close failed: %s", exc)
        self._on_close()
