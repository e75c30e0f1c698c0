"""Broker names and their declaration, the same on both sides.

Every name carries the deployment prefix, so tests and several deployments share one broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import uuid
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, Literal, TypeVar, cast

import aio_pika
import aiormq.abc
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import ChannelNotFoundEntity, DeliveryError
from aiormq.channel import Channel
from aiormq.exceptions import ChannelAccessRefused, ChannelLockedResource, ChannelPreconditionFailed
from pamqp.commands import Basic

from orch_contracts.errors import (
    BrokerUnavailable,
    StartupError,
    broker_errors,
    convert_broker_error,
)
from orch_contracts.output_frames import OutputFrames, publish_confirmed
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL

QueueType = Literal["classic", "quorum"]


class Topology:
    """The names of one deployment's exchanges and queues."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.work_queue = f"{prefix}.work"
        self.dead_letter_exchange = f"{prefix}.dead-letter"
        self.error_queue = f"{prefix}.errors"
        self.control_exchange = f"{prefix}.control"
        #: Durable topic exchange of committed outputs, routed by kind (``contracts/outputs.py``).
        self.outputs_exchange = f"{prefix}.outputs"

    def consumer_queue(self, name: str) -> str:
        """A consumer's own queue of outputs: ``<p>.consumer.<name>``, the names the consumer
        broker role may declare, and its length policy covers (``deploy/rabbitmq-users.sh``)."""
        return f"{self.prefix}.consumer.{name}"

    def work_queue_of(self, pool: str) -> str:
        """The work queue of one pool: ``<p>.work`` for the default pool (as before pools),
        ``<p>.work.<pool>`` for the others."""
        return self.work_queue if pool == DEFAULT_POOL else f"{self.work_queue}.{pool}"

    def control_queue(self, service_id: uuid.UUID | str) -> str:
        """One service's own (exclusive) control queue."""
        return f"{self.prefix}.control.{service_id}"


T = TypeVar("T")

#: Broker calls whose caller stopped waiting, left to finish (referenced until they do).
_left: set[asyncio.Task[Any]] = set()


async def finish_anyway(call: Coroutine[Any, Any, T]) -> T:
    """Await a broker call that opens or closes a channel, or waits on an RPC's answer; a
    caller that stops waiting (a timeout, a cancel) leaves it to finish on its own rather than
    cancel it. aiormq cancelled in the middle of a channel's open frees that channel's number
    while the broker has it open: the next channel opened with that number makes the broker
    close the whole connection ("second 'channel.open' seen"). On a loaded fleet, the leader's
    probes timed out and closed its publishing connection 831 times in 12 minutes."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            _left.add(task)
            task.add_done_callback(_finished)
        raise


def _finished(task: asyncio.Task[Any]) -> None:
    _left.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: the caller that would have seen it is gone


async def service_present(
    connection: AbstractConnection, topology: Topology, service_id: uuid.UUID
) -> bool:
    """Whether a service's exclusive control queue exists, i.e. its broker connection lives.

    A passive declare answers "locked" for an exclusive queue that another connection owns
    (it exists), "not found" for a missing one; either closes the channel, so each probe has
    one of its own. A caller that stops waiting (a timeout) leaves the probe to finish
    (``finish_anyway``). Raises BrokerUnavailable."""
    return await finish_anyway(_probe(connection, topology, service_id))


async def _probe(connection: AbstractConnection, topology: Topology, service_id: uuid.UUID) -> bool:
    channel: aiormq.abc.AbstractChannel | None = None
    with broker_errors():
        try:
            channel = await closable_channel(connection)
            await channel.queue_declare(topology.control_queue(service_id), passive=True)
            return True
        except ChannelLockedResource:
            return True
        except ChannelNotFoundEntity:
            return False
        finally:
            if channel is not None and not channel.is_closed:
                await channel.close()


#: Numbers for channels the broker may close (a probe's passive declare closes its channel),
#: taken in turn from a range of their own. aiormq frees a channel's number the moment the
#: broker's Channel.Close arrives, before its CloseOk is written, and gives the highest free
#: number to the next channel: a probe opened meanwhile on that number makes the broker close
#: the whole connection ("second 'channel.open' seen"). Forty probes at a time lost the
#: connection in 43-50 rounds of 100 so; in turn, a number comes back after 64,000 others.
_NUMBERS = (1024 + n % (65536 - 1024) for n in itertools.count())  # no copy kept, as cycle does


async def closable_channel(connection: AbstractConnection) -> aiormq.abc.AbstractChannel:
    """A channel of its own for passive declares, numbered from ``_NUMBERS``; a robust
    connection between two reconnects raises a plain RuntimeError ("... closed"), which means
    the broker is unavailable.

    The driver's own channel, not aio-pika's: each aio-pika channel hangs a callback on a new
    future chained to its connection's end, which its close never takes off (it removes it from
    another new future). About 2 KiB stayed for every probe: a leader that asks the work
    queue's count four times a second grew 58 MiB an hour."""
    transport = connection.transport
    if connection.is_closed or transport is None:
        raise BrokerUnavailable("broker connection is closed")
    for _ in range(64):
        try:
            return await transport.connection.channel(
                channel_number=next(_NUMBERS), publisher_confirms=False
            )
        except ValueError:  # that number is open on this connection: the next one
            continue
        except RuntimeError as exc:
            raise BrokerUnavailable(f"broker connection is down: {exc}") from exc
    raise BrokerUnavailable("no free channel number for a probe")


def publishing_blocked(connection: AbstractConnection | None) -> bool:
    """Whether the broker told this connection it blocks it (``connection.blocked``: a memory
    or disk alarm, after the connection published). A blocked connection sends nothing at all
    until the alarm ends, so a publish or a question on it would only wait. aiormq keeps the
    state in its connection's ``connection.unblocked`` event, which it exposes nowhere else;
    where that is not found, the answer is False (the calls' own timeouts still bound them)."""
    transport = getattr(connection, "transport", None)
    unblocked = getattr(
        getattr(transport, "connection", None), "_Connection__connection_unblocked", None
    )
    return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()


def broker_version(connection: AbstractConnection) -> tuple[int, ...]:
    """The broker's version from the connection's server properties, (0,) when unknown."""
    transport = getattr(connection, "transport", None)
    props: dict[str, Any] = getattr(getattr(transport, "connection", None), "server_properties", {})
    raw = props.get("version", b"")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    numbers = re.findall(r"\d+", text)
    return tuple(int(n) for n in numbers[:3]) or (0,)


#: The rabbitmq.conf line that keeps never-acked deliveries open for 7 days.
CONSUMER_TIMEOUT_CONF = "consumer_timeout = 604800000"


def consumer_timeout_advice(version: tuple[int, ...]) -> str | None:
    """What to tell an operator whose broker cannot take the timeout per queue (before 3.12):
    its own consumer_timeout (30 minutes by default) applies to the start messages that stay
    unacked while observers run: that often the channel closes, and every start is redelivered
    and adopted again (the copies go on)."""
    if version >= (3, 12) or version == (0,):
        return None
    shown = ".".join(map(str, version))
    return (
        f"RabbitMQ {shown} cannot take the consumer timeout per queue (3.12+ can): its own "
        "consumer_timeout (30 minutes unless set) closes the channel of every observer that "
        "runs longer (the copies go on; their starts are redelivered). Fix: add "
        f"`{CONSUMER_TIMEOUT_CONF}` to rabbitmq.conf (see deploy/rabbitmq.conf), or on a "
        "running broker: rabbitmqctl eval 'application:set_env(rabbit, consumer_timeout, "
        "604800000).' (it applies to channels opened afterwards)"
    )


def work_queue_arguments(
    *, version: tuple[int, ...], queue_type: QueueType, consumer_timeout_ms: int
) -> dict[str, Any]:
    """Arguments of the work queue for this broker version.

    Start messages stay unacked while their observer runs, so the consumer timeout is raised on
    the queue where the broker allows it (3.12+); older brokers need it in rabbitmq.conf.
    Quorum queues count a crash as a delivery; on 4.0+ the default limit (20) would drop an
    observer after 20 failovers, so it is lifted.
    """
    args: dict[str, Any] = {
        "x-queue-type": queue_type,
        "x-dead-letter-exchange": "",  # filled by declare_topology
    }
    if version >= (3, 12):
        args["x-consumer-timeout"] = consumer_timeout_ms
    if queue_type == "quorum" and version >= (4, 0):
        args["x-delivery-limit"] = -1
    return args


async def declare_topology(
    channel: AbstractChannel,
    topology: Topology,
    *,
    version: tuple[int, ...],
    queue_type: QueueType,
    consumer_timeout_ms: int,
    pool: str = DEFAULT_POOL,
) -> aio_pika.abc.AbstractQueue:
    """Declare the exchanges and queues both sides use, and the work queue of ``pool``, which
    it returns.

    A declaration the broker refuses (a queue that exists with other arguments, a user without
    the permissions) raises StartupError with the fix: the same declaration again cannot pass.
    """
    prefix = topology.prefix
    with _refused("the dead-letter exchange", topology.dead_letter_exchange, prefix):
        dlx = await channel.declare_exchange(
            topology.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
    other: QueueType = "quorum" if queue_type == "classic" else "classic"
    errors = await _declare_queue(
        channel,
        "error",
        topology.error_queue,
        prefix,
        {"x-queue-type": queue_type},
        {"x-queue-type": other},
    )
    with _refused("the error queue's binding", topology.error_queue, prefix):
        await errors.bind(dlx)
    with _refused("the control exchange", topology.control_exchange, prefix):
        await channel.declare_exchange(
            topology.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
    with _refused("the outputs exchange", topology.outputs_exchange, prefix):
        await channel.declare_exchange(
            topology.outputs_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
    return await declare_work_queue(
        channel,
        topology,
        pool,
        version=version,
        queue_type=queue_type,
        consumer_timeout_ms=consumer_timeout_ms,
    )


async def declare_work_queue(
    channel: AbstractChannel,
    topology: Topology,
    pool: str,
    *,
    version: tuple[int, ...],
    queue_type: QueueType,
    consumer_timeout_ms: int,
) -> aio_pika.abc.AbstractQueue:
    """Declare the work queue of one pool alone (the rest exists: ``declare_topology`` ran)."""
    args = work_queue_arguments(
        version=version, queue_type=queue_type, consumer_timeout_ms=consumer_timeout_ms
    )
    other: QueueType = "quorum" if queue_type == "classic" else "classic"
    before = work_queue_arguments(
        version=version, queue_type=other, consumer_timeout_ms=consumer_timeout_ms
    )
    args["x-dead-letter-exchange"] = before["x-dead-letter-exchange"] = (
        topology.dead_letter_exchange
    )
    return await _declare_queue(
        channel, "work", topology.work_queue_of(pool), topology.prefix, args, before
    )


async def publish_outputs(
    channel: AbstractChannel, topology: Topology, commits: Iterable[Committed]
) -> None:
    """Publish these commits' records on ``channel`` (with publisher confirms), in order as
    one chunk (``contracts/output_frames.py``), and wait for every confirm. Raises
    BrokerUnavailable (a nack included)."""
    with broker_errors():
        raw = cast(Channel, await channel.get_underlay_channel())
        frames = OutputFrames(
            channel=raw.number, max_body=raw.max_content_size, exchange=topology.outputs_exchange
        )
        async with asyncio.timeout(30):
            results = await publish_confirmed(raw, frames, commits)
    for r in results:
        if isinstance(r, DeliveryError):
            raise BrokerUnavailable(f"the broker did not confirm an output: {r!r}") from r
        if isinstance(r, Exception):
            converted = convert_broker_error(r)
            raise converted if converted is not r else BrokerUnavailable(str(r) or repr(r))
        if isinstance(r, BaseException):
            raise r
        if not isinstance(r, Basic.Ack):
            raise BrokerUnavailable(f"the broker did not confirm an output: {r!r}")


async def _declare_queue(
    channel: AbstractChannel,
    role: str,
    name: str,
    prefix: str,
    args: dict[str, Any],
    other_type: dict[str, Any],
) -> aio_pika.abc.AbstractQueue:
    """Declare one durable queue; when it exists with other arguments, raise the StartupError
    that says how it differs (``other_type``: the same queue of the other type, the likely
    cause: an ORCH_QUEUE_TYPE change). Probing with an equal declaration changes nothing."""
    with _refused(f"the {role} queue", name, prefix):
        try:
            return await channel.declare_queue(name, durable=True, arguments=args)
        except ChannelPreconditionFailed as exc:
            differs = f"asked {_shown(args)}"
            fix = "declare it as before (ORCH_QUEUE_TYPE, ORCH_CONSUMER_TIMEOUT_MS)"
            with contextlib.suppress(ChannelPreconditionFailed):
                await channel.reopen()  # the refusal closed the channel
                await channel.declare_queue(name, durable=True, arguments=other_type)
                differs = f"x-queue-type {other_type['x-queue-type']}, asked {args['x-queue-type']}"
                fix = "set ORCH_QUEUE_TYPE back"
            raise StartupError(
                f"the {role} queue {name} exists with other arguments ({differs}): delete it "
                f"(its messages go with it) or {fix}"
            ) from exc


def _shown(args: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in args.items())


@contextlib.contextmanager
def _refused(what: str, name: str, prefix: str) -> Iterator[None]:
    """A declaration refused for want of permissions: the StartupError that names them."""
    try:
        yield
    except ChannelAccessRefused as exc:
        raise StartupError(
            f"RabbitMQ refuses {what} {name} to this user ({exc}): grant it configure, write "
            f"and read permissions on names starting with {prefix}."
        ) from exc


async def delete_topology(
    amqp_url: str, topology: Topology, pools: Iterable[str] = (), *, timeout: float = 30.0
) -> None:
    """Delete the shared queues and exchanges of a prefix (outputs too: consumers' queues bound
    to it lose their binding), and the work queues of ``pools``
    (tests and benchmarks clean up with it), within ``timeout`` seconds (TimeoutError past
    it). Per-service control queues are exclusive and vanish with their connections."""
    async with asyncio.timeout(timeout):
        await _delete_topology(amqp_url, topology, pools)


async def _delete_topology(amqp_url: str, topology: Topology, pools: Iterable[str]) -> None:
    from orch_contracts.amqp import connect_first
    from orch_contracts.settings import split_urls

    connection, _ = await connect_first(split_urls(amqp_url), timeout=5)
    async with connection:
        queues = [topology.work_queue, topology.error_queue]
        queues += [topology.work_queue_of(p) for p in pools if p != DEFAULT_POOL]
        for queue in queues:
            channel = await connection.channel()  # a failed delete closes its channel
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.queue_delete(queue)
        exchanges = (
            topology.dead_letter_exchange,
            topology.control_exchange,
            topology.outputs_exchange,
        )
        for exchange in exchanges:
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.exchange_delete(exchange)
