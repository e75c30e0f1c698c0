"""Publishing to the broker with publisher confirms; declares the topology on connect."""

from __future__ import annotations

import json
import logging
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, DeliveryError

from contracts.messages import CONTROL_MESSAGE, DirectedStart, StartMessage
from contracts.settings import CommonSettings
from contracts.topology import broker_version, declare_topology

log = logging.getLogger(__name__)

START = "start"
CONTROL = "control"
DIRECT = "direct:"  # + service id: that service's control queue


def direct(service_id: object) -> str:
    return f"{DIRECT}{service_id}"


class Publisher:
    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.topology = settings.topology
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._control: AbstractExchange | None = None
        self.version: tuple[int, ...] = (0,)

    async def start(self) -> None:
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
        self._control = await self._channel.get_exchange(self.topology.control_exchange)

    @property
    def connected(self) -> bool:
        c = self._connection
        return c is not None and not c.is_closed and self._channel is not None

    async def publish(self, target: str, body: dict[str, Any] | bytes) -> None:
        """Publish one message and wait for the broker's confirm."""
        if self._channel is None or self._control is None:
            raise RuntimeError("publisher not started")
        data = body if isinstance(body, bytes) else _json(body)
        message = aio_pika.Message(
            data,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        if target == START:
            await self._channel.default_exchange.publish(
                message, routing_key=self.topology.work_queue, timeout=10
            )
        elif target == CONTROL:
            await self._control.publish(message, routing_key="", mandatory=False, timeout=10)
        elif target.startswith(DIRECT):
            queue = self.topology.control_queue(target.removeprefix(DIRECT))
            try:
                await self._channel.default_exchange.publish(message, routing_key=queue, timeout=10)
            except DeliveryError:
                # That service is gone, its queue with it. A directed start goes to the work
                # queue instead; anything else for it (a handoff) has nobody left to act on it.
                start = _start_of(data)
                if start is not None:
                    log.info("directed start to a vanished service; sent to the work queue")
                    await self.publish(START, start)
        else:
            raise ValueError(f"unknown target {target!r}")

    async def work_queue_ready(self) -> int:
        """Messages ready (not delivered) in the work queue."""
        if self._channel is None or not self.connected:
            raise ConnectionError("broker connection is down")
        # Straight to the AMQP channel: a robust channel's declare_queue returns its cached queue
        # object, whose message count is the one from the first declaration.
        try:
            raw = await self._channel.get_underlay_channel()
            ok = await raw.queue_declare(self.topology.work_queue, passive=True)
        except (AMQPError, RuntimeError) as exc:  # a channel closed under us
            raise ConnectionError(f"broker channel unusable: {exc}") from exc
        return int(ok.message_count or 0)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()


def _start_of(body: bytes) -> bytes | None:
    """The work-queue start message for a directed start (None for other control bodies)."""
    control = CONTROL_MESSAGE.validate_json(body)
    if not isinstance(control, DirectedStart):
        return None
    return StartMessage(observer_id=control.observer_id, dispatch_id=control.dispatch_id).to_bytes()


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), default=str).encode()
