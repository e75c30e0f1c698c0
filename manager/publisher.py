"""The manager's broker edge: publishing with confirms (through ``contracts.routing.Sender``),
declaring the topology on connect, and the few questions the leader asks the broker."""

from __future__ import annotations

import logging
import uuid

import aio_pika
import aiormq.abc
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from contracts.errors import BrokerUnavailable, broker_errors
from contracts.messages import Message
from contracts.routing import Destination, Sender
from contracts.settings import CommonSettings
from contracts.topology import broker_version, declare_topology, service_present

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.topology = settings.topology
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._sender: Sender | None = None
        self.version: tuple[int, ...] = (0,)

    async def start(self) -> None:
        with broker_errors():
            self._connection = await aio_pika.connect_robust(
                self.settings.amqp_url_with_heartbeat,
                timeout=10,
                client_properties={"connection_name": f"{self.topology.prefix} manager"},
            )
            self.version = broker_version(self._connection)
            self._channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            await declare_topology(
                self._channel,
                self.topology,
                version=self.version,
                queue_type=self.settings.queue_type,
                consumer_timeout_ms=self.settings.consumer_timeout_ms,
            )
        self._sender = Sender(self._channel, self.topology)

    @property
    def connected(self) -> bool:
        c = self._connection
        return c is not None and not c.is_closed and self._channel is not None

    async def deliver(self, to: Destination, message: Message) -> None:
        """Publish one message and wait for the broker's confirm; a directed start to a service
        that has vanished goes to the work queue instead. Raises BrokerUnavailable."""
        if self._sender is None:
            raise BrokerUnavailable("publisher not started")
        await self._sender.send(to, message)

    async def _raw(self) -> aiormq.abc.AbstractChannel:
        # Straight to the AMQP channel: a robust channel's declare_queue returns its cached queue
        # object, whose message count is the one from the first declaration.
        if self._channel is None or not self.connected:
            raise BrokerUnavailable("broker connection is down")
        return await self._channel.get_underlay_channel()

    async def work_queue_ready(self) -> int:
        """Messages ready (not delivered) in the work queue."""
        with broker_errors():
            raw = await self._raw()
            ok = await raw.queue_declare(self.topology.work_queue, passive=True)
        return int(ok.message_count or 0)

    async def service_present(self, service_id: uuid.UUID) -> bool:
        """Whether a service's broker connection lives (its control queue exists)."""
        if self._connection is None or not self.connected:
            raise BrokerUnavailable("broker connection is down")
        return await service_present(self._connection, self.topology, service_id)

    async def close(self) -> None:
        if self._connection is not None:
            with broker_errors():
                await self._connection.close()
