"""The outputs, judged from what a plain consumer received: a queue of the campaign's own, bound
to ``<prefix>.outputs`` before the first observer is created.

Per observer:

- *repeats*: a ``message_id`` received again (counted; allowed);
- *gaps*: committed seqs (1 to the observer's ``output_seq`` at the end) never received;
- *out of order*: a seq that first arrived after a higher one had;
- *stale*: a record whose epoch is older than the epoch of a record with a lower seq, that is,
  committed by an epoch after a later epoch's first commit (the fence failed);
- *conflicts*: a seq received twice with another epoch or another record: two records under
  one ``message_id``, of which a consumer dropping repeats keeps whichever came first (a
  refused commit's records were published).

Gaps, out of order, stale records and conflicts break the promise of delivery; repeats do not.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aio_pika

from orch_contracts.outputs import Output
from orch_contracts.topology import Topology


@dataclass
class OutputFindings:
    #: Distinct records received, and repeats.
    received: int = 0
    repeats: dict[str, int] = field(default_factory=dict)
    gaps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    out_of_order: dict[str, list[int]] = field(default_factory=dict)
    stale: dict[str, list[int]] = field(default_factory=dict)
    conflicts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        return not (self.gaps or self.out_of_order or self.stale or self.conflicts)

    def lines(self, kinds: dict[str, str]) -> list[str]:
        out = []
        for oid, gaps in sorted(self.gaps.items()):
            shown = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in gaps[:5])
            out.append(
                f"OUTPUT GAP {kinds.get(oid, '?')} {oid}: seq {shown} committed, never received"
            )
        for oid, seqs in sorted(self.out_of_order.items()):
            out.append(
                f"OUTPUT OUT OF ORDER {kinds.get(oid, '?')} {oid}: seq {seqs[:5]} arrived after a "
                "higher one"
            )
        for oid, seqs in sorted(self.stale.items()):
            out.append(
                f"STALE OUTPUT {kinds.get(oid, '?')} {oid}: seq {seqs[:5]} from an epoch older "
                "than an earlier record's"
            )
        for oid, seqs in sorted(self.conflicts.items()):
            out.append(
                f"OUTPUT CONFLICT {kinds.get(oid, '?')} {oid}: seq {seqs[:5]} received as two "
                "different records"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "repeats": self.repeats,
            "gaps": self.gaps,
            "out_of_order": self.out_of_order,
            "stale": self.stale,
            "conflicts": self.conflicts,
        }


def judge_outputs(outputs: list[Output], committed: dict[str, int]) -> OutputFindings:
    """``outputs``: as received, in order; ``committed``: per observer, its last committed
    seq at the end."""
    f = OutputFindings()
    seen: dict[str, set[int]] = defaultdict(set)
    highest: dict[str, int] = {}
    epochs: dict[str, dict[int, int]] = defaultdict(dict)
    first: dict[tuple[str, int], Output] = {}
    for o in outputs:
        oid = str(o.observer_id)
        if o.seq in seen[oid]:
            f.repeats[oid] = f.repeats.get(oid, 0) + 1
            was = first[(oid, o.seq)]
            if (was.epoch, was.record) != (o.epoch, o.record):
                f.conflicts.setdefault(oid, []).append(o.seq)
            continue
        seen[oid].add(o.seq)
        first[(oid, o.seq)] = o
        epochs[oid][o.seq] = o.epoch
        if o.seq < highest.get(oid, 0):
            f.out_of_order.setdefault(oid, []).append(o.seq)
        highest[oid] = max(highest.get(oid, 0), o.seq)
    f.received = sum(len(s) for s in seen.values())
    for oid, top in committed.items():
        missing = sorted(set(range(1, top + 1)) - seen.get(oid, set()))
        if missing:
            f.gaps[oid] = _ranges(missing)
    for oid, by_seq in epochs.items():
        newest = 0
        for seq in sorted(by_seq):
            if by_seq[seq] < newest:
                f.stale.setdefault(oid, []).append(seq)
            newest = max(newest, by_seq[seq])
    return f


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in seqs:
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


class OutputWatch:
    """The campaign's consumer: every output message, as received."""

    def __init__(self, amqp_url: str, topology: Topology) -> None:
        self.amqp_url = amqp_url
        self.topology = topology
        self.outputs: list[Output] = []
        self.unreadable = 0
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._queue: aio_pika.abc.AbstractQueue | None = None

    async def start(self) -> None:
        # Robust: a broker restart among the faults must not end the watch (its queue is
        # durable, so what is routed meanwhile waits in it).
        self._connection = await aio_pika.connect_robust(self.amqp_url)
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=1000)
        exchange = await channel.declare_exchange(
            self.topology.outputs_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(f"{self.topology.prefix}.verify-outputs", durable=True)
        await queue.bind(exchange, routing_key="#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            try:
                self.outputs.append(Output.from_message(message.body, dict(message.headers)))
            except ValueError:
                self.unreadable += 1
            await message.ack()

        await queue.consume(on_message)
        self._queue = queue

    def received_up_to(self, observer: str, seq: int) -> bool:
        """Whether every seq from 1 to ``seq`` of ``observer`` was received."""
        got = {o.seq for o in self.outputs if str(o.observer_id) == observer and o.seq <= seq}
        return len(got) >= seq

    async def close(self) -> None:
        if self._connection is not None:
            try:
                if self._queue is not None:
                    await self._queue.delete(if_unused=False, if_empty=False)
            except Exception:
                pass
            await self._connection.close()
