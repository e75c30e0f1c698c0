"""The service's broker edge: one AMQP session (a connection, a work channel, a control channel).

A session is never repaired in place: when anything in it closes, the service opens a new one.
The copies delivered on the old one go on (the broker is no reason to stop a copy; the lease
is what proves it is the only one); their deliveries are gone and they run as directed until a
redelivery of their start reaches this service again and is adopted. aio-pika errors become
``BrokerUnavailable`` here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)
from aiormq import spec
from aiormq.exceptions import (
    AMQPChannelError,
    AMQPConnectionError,
    ChannelPreconditionFailed,
    ConnectionClosed,
)

from observer_service.ports import SessionSpec, Settling
from orch_contracts import tracing
from orch_contracts.amqp import connect_first
from orch_contracts.errors import BrokerUnavailable, broker_errors
from orch_contracts.messages import CancelMessage, StartMessage
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.routing import BROADCAST, ERRORS, Sender
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import (
    Topology,
    broker_version,
    declare_topology,
    publish_outputs,
    service_present,
)

log = logging.getLogger(__name__)
_generations = itertools.count(1)


class AmqpDelivery(Settling):
    """A start message delivered on one session; settling it after that session closed does
    nothing (the broker requeued it when the channel closed)."""

    def __init__(self, message: AbstractIncomingMessage, session: AmqpSession) -> None:
        self.message = message
        self.body = message.body
        self.redelivered = bool(message.redelivered)
        self.trace = tracing.carrier_of(message.headers)
        self._session = session

    @property
    def live(self) -> bool:
        return self._session.is_open

    async def _settle(self, how: str) -> bool:
        if not self.live:
            return False
        try:
            with broker_errors():
                if how == "ack":
                    await self.message.ack()
                elif how == "requeue":
                    await self.message.nack(requeue=True)
                else:
                    await self.message.reject(requeue=False)
            return True
        except BrokerUnavailable as exc:
            log.debug("could not %s a message (its channel is gone): %s", how, exc)
            return False


class AmqpSession:
    def __init__(self, settings: CommonSettings, pool: str = DEFAULT_POOL) -> None:
        self.settings = settings
        self.topology: Topology = settings.topology
        #: The service's pool: the work queue it consumes, where the starts it releases go.
        self.pool = pool
        self.generation = next(_generations)
        self.closed = asyncio.Event()
        self.close_reason = ""
        #: We close it (``close``): its end is no trouble to warn of.
        self._closing = False
        self.connection: AbstractConnection | None = None
        #: The node this session is on (one of ``ORCH_AMQP_URL``'s).
        self.url: str | None = None
        self._lookout: AbstractConnection | None = None
        self.version: tuple[int, ...] = (0,)
        self._work_queue: AbstractQueue | None = None
        self._work_tag: str | None = None
        self._on_start_message: Callable[[AbstractIncomingMessage], Awaitable[None]] | None = None
        self._sender: Sender | None = None
        self._outputs: AbstractChannel | None = None
        self.service_id = uuid.UUID(int=0)

    @property
    def is_open(self) -> bool:
        return not self.closed.is_set()

    def _on_close(self, _sender: Any = None, exc: BaseException | None = None) -> None:
        if self.closed.is_set():
            return
        if self._closing:  # its connection ends as we asked, whatever the callback says
            self.close_reason = close_reason(None)
            log.info("broker session %d closed", self.generation)
        else:
            self.close_reason = close_reason(exc)
            log.warning(
                "broker session %d closed (%s: %s)", self.generation, self.close_reason, exc
            )
        self.closed.set()

    def _on_consumer_cancel(self, frame: spec.Basic.Cancel) -> None:
        """The broker cancelled our work consumer (its queue was deleted), the only one on the
        work channel: the session ends, so its deliveries settle nothing (the copies publish
        their starts anew when they release), and the next session declares the queue again and
        consumes it."""
        self._on_close(exc=ConsumerCancelled(f"consumer {frame.consumer_tag} cancelled"))

    async def open(self, spec: SessionSpec, *, lost: str | None = None) -> None:
        """Connect (``lost``: the node of the session before, tried last) and set up."""
        topo = self.topology
        service_id = self.service_id = spec.service_id
        with broker_errors():
            self.connection, url = await connect_first(
                self.settings.amqp_urls,
                lost=lost,
                timeout=10,
                client_properties={
                    "connection_name": f"{topo.prefix} observer-service {service_id}"
                },
            )
            self.url = url
            self.connection.close_callbacks.add(self._on_close)
            self.version = broker_version(self.connection)
            # Questions about other services go on a connection of their own: on the session's
            # connection their answers would queue behind a burst of deliveries (a failover).
            # Same node: the two are lost together, and the session opens again as one.
            self._lookout = await aio_pika.connect(
                url,
                timeout=10,
                client_properties={"connection_name": f"{topo.prefix} lookout {service_id}"},
            )
            work = await self.connection.channel(publisher_confirms=False)
            work.close_callbacks.add(self._on_close)
            raw = await work.get_underlay_channel()
            raw.on_consumer_cancel_callbacks.add(self._on_consumer_cancel)
            await work.set_qos(prefetch_count=spec.prefetch)
            queue = await declare_topology(
                work,
                topo,
                version=self.version,
                queue_type=self.settings.queue_type,
                consumer_timeout_ms=self.settings.consumer_timeout_ms,
                pool=self.pool,
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

            async def control_message(message: AbstractIncomingMessage) -> None:
                await spec.on_control(message.body, tracing.carrier_of(message.headers))

            async def start_message(message: AbstractIncomingMessage) -> None:
                await spec.on_start(AmqpDelivery(message, self))

            await cq.consume(control_message, no_ack=True)
            self._work_queue = queue
            self._on_start_message = start_message
            self._sender = Sender(control, topo)
            # Outputs on a channel of their own: thousands of confirms in flight must not
            # queue directed starts behind them.
            self._outputs = await self.connection.channel(publisher_confirms=True)
            self._outputs.close_callbacks.add(self._on_close)
            if spec.consume_work:
                self._work_tag = await queue.consume(start_message)

    async def send_start(self, start: StartMessage, on: uuid.UUID | None = None) -> None:
        await self._live_sender().send_start(start, on, pool=self.pool)

    async def send_error(self, start: StartMessage) -> None:
        await self._live_sender().publish(ERRORS, start)

    async def send_cancel(self, observer_id: uuid.UUID) -> None:
        await self._live_sender().publish(BROADCAST, CancelMessage(observer_id=observer_id))

    async def publish_outputs(self, commits: Sequence[Committed]) -> None:
        if self._outputs is None or not self.is_open:
            raise BrokerUnavailable("broker session is not open")
        await publish_outputs(self._outputs, self.topology, commits)

    def _live_sender(self) -> Sender:
        if self._sender is None or not self.is_open:
            raise BrokerUnavailable("broker session is not open")
        return self._sender

    async def service_present(self, service_id: uuid.UUID) -> bool:
        """Whether that service's broker connection lives (its control queue exists)."""
        connection = self._open_connection()
        lookout = self._lookout
        if lookout is not None and not lookout.is_closed:
            connection = lookout
        return await service_present(connection, self.topology, service_id)

    def _open_connection(self) -> AbstractConnection:
        if self.connection is None or not self.is_open:
            raise BrokerUnavailable("broker session is not open")
        return self.connection

    async def stop_consuming(self) -> None:
        """Take no more start messages (those already delivered stay ours to settle)."""
        if self._work_queue is not None and self._work_tag is not None and self.is_open:
            tag, self._work_tag = self._work_tag, None
            try:
                with broker_errors():
                    await self._work_queue.cancel(tag, timeout=5)
            except BrokerUnavailable as exc:
                log.warning("could not cancel the work consumer: %s", exc)

    async def start_consuming(self) -> None:
        """Take start messages again (after a drain was undone)."""
        queue, on_message = self._work_queue, self._on_start_message
        if queue is None or on_message is None or self._work_tag is not None or not self.is_open:
            return
        try:
            with broker_errors():
                self._work_tag = await queue.consume(on_message)
        except BrokerUnavailable as exc:
            # The session is closing: the next one is opened consuming (no longer draining).
            log.warning("could not consume the work queue again: %s", exc)

    async def close(self) -> None:
        self._closing = True
        for connection in (self._lookout, self.connection):
            if connection is not None and not connection.is_closed:
                try:
                    with broker_errors():
                        await connection.close()
                except BrokerUnavailable as exc:
                    log.warning("broker close failed: %s", exc)
        self._on_close()


class AmqpBroker:
    def __init__(self, settings: CommonSettings, pool: str = DEFAULT_POOL) -> None:
        self.settings = settings
        self.pool = pool
        #: The node of the last session: a session opens after the one before it was lost.
        self._last: str | None = None

    async def open(self, spec: SessionSpec) -> AmqpSession:
        session = AmqpSession(self.settings, self.pool)
        try:
            await session.open(spec, lost=self._last)
        except BaseException:
            await session.close()
            raise
        finally:
            self._last = session.url or self._last
        return session


class ConsumerCancelled(Exception):
    """Why a session ended when the broker cancelled its work consumer (a close reason, never
    raised)."""


def close_reason(exc: BaseException | None) -> str:
    """A short label for why a session closed: by its AMQP reply (precondition_failed is what
    the broker's consumer timeout sends), or how the connection ended."""
    if exc is None:
        return "closed_here"
    if isinstance(exc, ConsumerCancelled):
        return "consumer_cancelled"
    if isinstance(exc, ChannelPreconditionFailed):
        return "precondition_failed"
    if isinstance(exc, AMQPChannelError | AMQPConnectionError) and not isinstance(
        exc, ConnectionClosed
    ):
        return snake(type(exc).__name__)
    return "connection_lost"


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
