"""The manager's broker edge: publishing with confirms (through ``orch_contracts.routing.Sender``),
declaring the topology on connect, and the few questions the leader asks the broker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import ChannelNotFoundEntity

from orch_contracts.amqp import connect_first
from orch_contracts.backoff import Backoff
from orch_contracts.errors import (
    BrokerRefused,
    BrokerUnavailable,
    StartupError,
    Unroutable,
    broker_errors,
)
from orch_contracts.messages import Message
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.routing import Destination, Sender
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import (
    broker_version,
    closable_channel,
    declare_topology,
    declare_work_queue,
    finish_anyway,
    publish_outputs,
    publishing_blocked,
    service_present,
)

log = logging.getLogger(__name__)
#: Seconds a shutdown waits for the broker connection to close.
CLOSE_TIMEOUT = 5.0


class Publisher:
    """One connection to one node of the broker (``ORCH_AMQP_URL`` may list several); when it
    is lost, the publisher connects again, to the next node that answers, until closed. Until
    then every call raises BrokerUnavailable: the outbox keeps what was not confirmed.

    The leader's questions (is a service's control queue there, how many starts are ready) go
    on a *lookout* connection of their own, which publishes nothing: a broker alarm blocks a
    connection once it publishes, and a blocked connection sends nothing at all, so on the
    publishing connection they would wait for the alarm's end. While the broker blocks the
    publishing connection, a publish fails at once (the outbox keeps it; the services read
    their directed starts from the outbox meanwhile)."""

    def __init__(
        self,
        settings: CommonSettings,
        *,
        timeout: float = 3.0,
        probe_timeout: float = 1.0,
        died: Callable[[asyncio.Task[None]], None] | None = None,
    ) -> None:
        self.settings = settings
        #: Told when the reconnect task dies of anything but a stop: without it the manager
        #: would never publish again, so its owner stops the process loudly.
        self._died = died
        self.topology = settings.topology
        self._connection: AbstractConnection | None = None
        self._lookout: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._sender: Sender | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        #: The node connected to last (tried last when connecting again).
        self._url: str | None = None
        self._closing = False
        self.version: tuple[int, ...] = (0,)
        self._declaring = asyncio.Lock()
        #: The pools whose work queue this connection declared (the default pool's at once).
        self._pools: set[str] = {DEFAULT_POOL}
        #: Seconds a publish (with its confirm) or a probe may take: past it, the broker counts
        #: as unavailable (a memory or disk alarm blocks publishes without closing anything).
        self.timeout = timeout
        #: Seconds a probe (a passive declare) may take; past it, it counts as failed.
        self.probe_timeout = probe_timeout

    async def start(self) -> None:
        await self._open()

    async def _open(self) -> None:
        with broker_errors():
            connection, self._url = await connect_first(
                self.settings.amqp_urls,
                lost=self._url,
                timeout=10,
                client_properties={"connection_name": f"{self.topology.prefix} manager"},
            )
            lookout: AbstractConnection | None = None
            try:
                version = broker_version(connection)
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                await declare_topology(
                    channel,
                    self.topology,
                    version=version,
                    queue_type=self.settings.queue_type,
                    consumer_timeout_ms=self.settings.consumer_timeout_ms,
                )
                lookout = await aio_pika.connect(
                    self._url,
                    timeout=10,
                    client_properties={
                        "connection_name": f"{self.topology.prefix} manager lookout"
                    },
                )
            except BaseException:
                for c in (connection, lookout):
                    if c is not None:
                        with contextlib.suppress(Exception):
                            await c.close()
                raise
        if self._closing:  # a reconnect that outlived the close
            for c in (connection, lookout):
                with contextlib.suppress(Exception):
                    await c.close()
            return
        if any(c.is_closed for c in (connection, channel, lookout)):
            # Closed before its callback could be there (the lookout's connect takes a
            # while): nothing would ever see it. From here on no await: none can be missed.
            for c in (connection, lookout):
                with contextlib.suppress(Exception):
                    await c.close()
            raise BrokerUnavailable("the broker closed the connection while it was set up")
        self.version = version
        self._pools = {DEFAULT_POOL}
        self._connection, self._channel, self._lookout = connection, channel, lookout
        self._sender = Sender(channel, self.topology)
        for closing in (connection, channel, lookout):
            closing.close_callbacks.add(self._lost)

    def _lost(self, _sender: object = None, exc: BaseException | None = None) -> None:
        """The connection or its channel closed: connect again (once at a time)."""
        if self._closing or (self._reconnecting is not None and not self._reconnecting.done()):
            return
        log.warning("broker connection lost (%s): connecting again", exc or "closed")
        self._sender = None
        task = asyncio.get_running_loop().create_task(self._reconnect(), name="broker-reconnect")
        task.add_done_callback(self._reconnect_ended)
        self._reconnecting = task

    def _reconnect_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.critical("reconnecting to the broker failed for good (%r)", task.exception())
        if self._died is not None:
            self._died(task)

    async def _reconnect(self) -> None:
        for old in (self._connection, self._lookout):
            if old is not None and not old.is_closed:
                with contextlib.suppress(Exception):
                    await old.close()  # a channel or one connection closed alone: afresh
        backoff = Backoff(0.1, 1.0, jitter=0.5)  # as a service's: back within 1.5 s of it
        while not self._closing:
            try:
                await self._open()
            except BrokerUnavailable as exc:
                log.warning("broker still unreachable: %s", exc)
                await asyncio.sleep(backoff.next())
                continue
            log.info("broker connection restored")
            return

    @property
    def connected(self) -> bool:
        c, ch = self._connection, self._channel
        return c is not None and not c.is_closed and ch is not None and not ch.is_closed

    async def deliver(self, to: Destination, message: Message) -> None:
        """Publish one message and wait for the broker's confirm; a directed start to a service
        that has vanished goes to the work queue instead. Raises BrokerUnavailable."""
        if self._sender is None:
            raise BrokerUnavailable("publisher not started")
        self._unblocked()
        if to.pool not in self._pools:  # a pool's first start: its queue may not exist yet
            await self._declare(to.pool, unless_done=True)
        try:
            await self._sender.send(to, message, timeout=self.timeout)
        except Unroutable as exc:
            # The work queue is gone (deleted): declare it again so that the retry lands.
            await self._declare(exc.pool or DEFAULT_POOL)
            raise

    async def publish_outputs(self, commits: Sequence[Committed]) -> None:
        """Publish the records of these commits of outputs in order, waiting for every
        confirm (``orch_contracts.topology.publish_outputs``). Raises BrokerUnavailable."""
        channel = self._channel
        if channel is None or not self.connected:
            raise BrokerUnavailable("broker connection is down")
        self._unblocked()
        await publish_outputs(channel, self.topology, commits)

    @property
    def blocked(self) -> bool:
        """The broker blocks this publisher's connection now (a memory or disk alarm)."""
        return publishing_blocked(self._connection)

    def _unblocked(self) -> None:
        if self.blocked:
            raise BrokerUnavailable("the broker blocks publishers (a memory or disk alarm)")

    async def _declare(self, pool: str = DEFAULT_POOL, *, unless_done: bool = False) -> None:
        """Declare the topology again on the open channel (for another pool: that pool's work
        queue), once at a time (``unless_done``: not again for a pool declared meanwhile). A
        failure is logged: the publish that follows comes back, and stays in the outbox for
        the relay (a broker that refuses the queue, for want of permissions or for other
        arguments, is told in the log each time, never by stopping the manager)."""
        async with self._declaring:
            channel = self._channel
            if channel is None or not self.connected or (unless_done and pool in self._pools):
                return
            declare = declare_topology if pool == DEFAULT_POOL else declare_work_queue
            try:
                with broker_errors():
                    async with asyncio.timeout(self.timeout):
                        await declare(
                            channel,
                            self.topology,
                            pool=pool,
                            version=self.version,
                            queue_type=self.settings.queue_type,
                            consumer_timeout_ms=self.settings.consumer_timeout_ms,
                        )
                self._pools.add(pool)
            except BrokerUnavailable as exc:
                log.warning("could not declare the topology again: %s", exc)
            except (StartupError, BrokerRefused) as exc:
                log.error("the work queue of pool %r cannot be declared: %s", pool, exc)

    async def work_queue_ready(self, pool: str = DEFAULT_POOL) -> int:
        """Messages ready (not delivered) in a pool's work queue."""
        return (await self.work_queue_counts(pool))[0]

    async def work_queue_counts(self, pool: str = DEFAULT_POOL) -> tuple[int, int]:
        """A pool's work queue: messages ready (not delivered), and consumers. It is asked on
        a channel of its own: a queue nobody declared yet (0, 0) must not close the
        publishing channel."""
        with broker_errors():
            async with asyncio.timeout(self.probe_timeout):
                # Left to finish on a timeout: an RPC or a channel's open cancelled midway
                # desynchronises the connection (``orch_contracts.topology.finish_anyway``).
                return await finish_anyway(self._counts(pool))

    async def _counts(self, pool: str) -> tuple[int, int]:
        channel = await closable_channel(self._looking())
        try:
            ok = await channel.queue_declare(self.topology.work_queue_of(pool), passive=True)
            return int(ok.message_count or 0), int(ok.consumer_count or 0)
        except ChannelNotFoundEntity:
            return 0, 0
        finally:
            if not channel.is_closed:
                await channel.close()

    def _looking(self) -> AbstractConnection:
        """The lookout connection, for questions."""
        lookout = self._lookout
        if lookout is None or lookout.is_closed or not self.connected:
            raise BrokerUnavailable("broker connection is down")
        return lookout

    async def service_present(self, service_id: uuid.UUID) -> bool:
        """Whether a service's broker connection lives (its control queue exists)."""
        lookout = self._looking()
        with broker_errors():
            async with asyncio.timeout(self.probe_timeout):
                return await service_present(lookout, self.topology, service_id)

    async def close(self) -> None:
        self._closing = True
        task = self._reconnecting
        if task is not None and not task.done():  # one that died was told to the owner
            task.cancel()
            # Bounded: a connect caught in its TCP handshake can outlast its cancel.
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT)
        if self._lookout is not None:
            with contextlib.suppress(BrokerUnavailable), broker_errors():
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self._lookout.close()
        if self._connection is not None:
            # Bounded: a close caught in the middle of a reconnect can wait on a connect that
            # never completes (seen once in CI: a manager's shutdown hung for five minutes).
            with broker_errors():
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self._connection.close()
