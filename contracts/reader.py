"""A consumer's side of the outputs: drop repeats, see gaps and what comes out of order.

Per observer, records are published in ``seq`` order and a retry may repeat one, so a reader
needs only the last ``seq`` it delivered of each observer: a record at or below it is a repeat,
the next one is delivered, one beyond it is delivered after a *gap* (records that never
arrived: the queue was bound late, or a message was lost past the broker). Memory: one integer
per observer.

With plain aio-pika::

    import aio_pika
    from orch_contracts.reader import OutputReader

    reader = OutputReader()
    reader.resume(load_last_seqs())              # what you stored with your own data, if any
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1/")
    channel = await connection.channel()
    exchange = await channel.declare_exchange(
        "orch.outputs", aio_pika.ExchangeType.TOPIC, durable=True
    )
    queue = await channel.declare_queue("orch.consumer.mine", durable=True)
    await queue.bind(exchange, routing_key="#")  # or one kind's name
    async with queue.iterator() as messages:
        async for message in messages:
            verdict = reader.accept(message.body, message.headers)
            if verdict.deliver:
                handle(verdict.output.record)    # store reader.last[...] with it
            await message.ack()

``reader.delivered``, ``reader.repeats`` and ``reader.gaps`` count what it saw; ``accept``
says, per message, whether to deliver it and what gap (if any) came before it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orch_contracts.outputs import Output


@dataclass(frozen=True)
class Verdict:
    output: Output
    #: New: hand it on. False for a repeat (its seq was delivered already).
    deliver: bool
    #: The seqs that never arrived before it (first, last), or None.
    gap: tuple[int, int] | None = None


@dataclass
class OutputReader:
    """See the module's docstring."""

    #: Per observer, the last seq delivered.
    last: dict[uuid.UUID, int] = field(default_factory=dict)
    delivered: int = 0
    repeats: int = 0
    #: Gaps seen: (observer, first missing seq, last missing seq).
    gaps: list[tuple[uuid.UUID, int, int]] = field(default_factory=list)
    #: The first record of an observer not resumed is expected to be seq 1 (else a gap): false
    #: for a reader that joins a running stream (``orch outputs tail``).
    from_start: bool = True

    def resume(self, last: Mapping[uuid.UUID | str, int]) -> None:
        """Start from what a consumer stored: per observer, the last seq it handled."""
        for observer, seq in last.items():
            self.last[uuid.UUID(str(observer))] = int(seq)

    def accept(self, body: bytes | Output, headers: Mapping[str, Any] | None = None) -> Verdict:
        """One received message (its body and headers, or an ``Output``); ValueError for a
        message that is not an output."""
        output = (
            body if isinstance(body, Output) else Output.from_message(body, dict(headers or {}))
        )
        before = self.last.get(output.observer_id)
        if before is not None and output.seq <= before:
            self.repeats += 1
            return Verdict(output, deliver=False)
        gap = None
        expected = (1 if self.from_start else output.seq) if before is None else before + 1
        if output.seq > expected:
            gap = (expected, output.seq - 1)
            self.gaps.append((output.observer_id, *gap))
        self.last[output.observer_id] = output.seq
        self.delivered += 1
        return Verdict(output, deliver=True, gap=gap)
