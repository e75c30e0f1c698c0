"""The broker's own floor for failover: bare aio-pika consumers that "run" unacked messages.

Each consumer process takes messages from one queue with a large prefetch, never acks them,
and ticks every ``interval`` for each message it holds, into the same tick logs the recorder
kind writes. SIGKILL one: the broker requeues its messages and the other consumer takes them;
the gap from the last tick before the kill to the first tick on the other consumer is the
floor any orchestrator on this broker pays. ``orch bench`` measures it in the same run as the
orchestrator's own failover, the same way.

Run as ``python -m orch_bench.floor AMQP_URL QUEUE TICK_DIR INTERVAL``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import aio_pika

from orch.cluster import LocalCluster, quiet, wait_for
from orch_bench.ticklog import failover_gaps, read_ticks
from orch_contracts.witness import tick_line


async def consume(url: str, queue_name: str, tick_dir: Path, interval: float) -> None:
    out = (tick_dir / f"{os.getpid()}.jsonl").open("a", buffering=1)
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=65_000)
    queue = await channel.declare_queue(queue_name, durable=False, auto_delete=False)
    tasks: set[asyncio.Task[None]] = set()

    async def tick(observer: str, epoch: int) -> None:
        n = 0
        while True:
            n += 1
            out.write(tick_line(observer, epoch, "floor", n))  # as the recorder kind writes
            await asyncio.sleep(interval)

    async def held(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        epoch = 2 if message.redelivered else 1
        task = asyncio.create_task(tick(message.body.decode(), epoch))
        tasks.add(task)

    await queue.consume(held)
    print("consuming", flush=True)
    await asyncio.Event().wait()


async def measure_floor(
    cluster: LocalCluster,
    url: str,
    workdir: Path,
    count: int,
    interval: float,
    *,
    from_fault: bool = False,
) -> list[float]:
    """Seconds of failover gap per message, for ``count`` messages held by one consumer that is
    SIGKILLed while a second one waits (from the kill itself with ``from_fault``: see
    ``failover_gaps``). Both consumers are processes of ``cluster``."""
    queue_name = f"orch-floor-{uuid.uuid4().hex[:8]}"
    ticks = workdir / "floor-ticks"
    ticks.mkdir(parents=True, exist_ok=True)
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue_name, durable=False, auto_delete=False)
        try:
            args = [url, queue_name, str(ticks), str(interval)]
            first = cluster.spawn("floor-a", args, module="orch_bench.floor")
            await first.wait_log("consuming")
            for i in range(count):
                await channel.default_exchange.publish(
                    aio_pika.Message(f"floor-{i}".encode()), routing_key=queue_name
                )

            async def held_by_first() -> bool:
                return len({t.observer for t in read_ticks(ticks) if t.pid == first.pid}) == count

            patience = max(60.0, count / 200)
            await wait_for(held_by_first, timeout=patience, what="the floor's messages held")
            second = cluster.spawn("floor-b", args, module="orch_bench.floor")
            await second.wait_log("consuming")
            await quiet(1.0, "let both consumers settle before the kill")
            at = time.time()
            first.signal(signal.SIGKILL)

            async def all_moved() -> dict[str, float] | None:
                gaps = failover_gaps(read_ticks(ticks), at, first.pid, from_fault=from_fault)
                done = len(gaps) == count and float("inf") not in gaps.values()
                return gaps if done else None

            gaps = await wait_for(all_moved, timeout=patience, what="the floor's messages moved")
            second.signal(signal.SIGKILL)
            return list(gaps.values())
        finally:
            await channel.queue_delete(queue_name)


if __name__ == "__main__":
    url, queue, directory, every = sys.argv[1:5]
    asyncio.run(consume(url, queue, Path(directory), float(every)))
