"""``orch outputs tail``: what observers emit, as it is published, for people.

An exclusive queue of its own, ``<prefix>.consumer.tail-<random>`` (a name the consumer broker
role may declare), bound to ``<prefix>.outputs`` (one kind, or ``#``), gone when the command
ends; one line per record, and one for each gap the reader sees (``orch_contracts.reader``: it joins
a running stream, so the first record of each observer starts its count).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika

from orch_contracts.amqp import connect_first
from orch_contracts.errors import broker_errors
from orch_contracts.logs import safe_text
from orch_contracts.reader import OutputReader, Verdict
from orch_contracts.settings import CommonSettings

#: A record is shown cut to this many characters (``--json`` shows it whole).
WIDTH = 160


def line(verdict: Verdict) -> str:
    o = verdict.output
    at = time.strftime("%H:%M:%S", time.localtime(o.committed_at))
    record = json.dumps(o.record, separators=(",", ":"), ensure_ascii=False)
    if len(record) > WIDTH:
        record = record[: WIDTH - 1] + "…"
    head = f"{at} {safe_text(o.name)} seq {o.seq} epoch {o.epoch}"
    return f"{head} {safe_text(record)}"


def as_json(verdict: Verdict) -> str:
    o = verdict.output
    return json.dumps(
        {
            "observer_id": str(o.observer_id),
            "name": o.name,
            "kind": o.kind,
            "seq": o.seq,
            "epoch": o.epoch,
            "committed_at": o.committed_at,
            "record": o.record,
            "gap": list(verdict.gap) if verdict.gap else None,
        },
        ensure_ascii=False,
    )


async def tail(
    settings: CommonSettings,
    *,
    kind: str | None,
    observer: str | None,
    show: Callable[[str], None],
    json_lines: bool,
    stop: asyncio.Event,
) -> OutputReader:
    """Print what arrives until ``stop`` is set; returns the reader (its counts)."""
    reader = OutputReader(from_start=False)
    topology = settings.topology
    with broker_errors():
        connection, _ = await connect_first(
            settings.amqp_urls,
            timeout=10,
            client_properties={"connection_name": f"{topology.prefix} orch outputs tail"},
        )
    try:
        with broker_errors():
            channel = await connection.channel()
            # Passive: the consumer role may read the exchange, not declare it; and a queue
            # of its own names, not the broker's ``amq.gen-…``.
            exchange = await channel.get_exchange(topology.outputs_exchange)
            queue = await channel.declare_queue(
                topology.consumer_queue(f"tail-{uuid.uuid4().hex[:12]}"),
                exclusive=True,
                auto_delete=True,
            )
            await queue.bind(exchange, routing_key=kind or "#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            headers: dict[str, Any] = dict(message.headers)
            try:
                verdict = reader.accept(message.body, headers)
            except ValueError as exc:
                show(f"not an output message ({exc})")
                return
            o = verdict.output
            if observer is not None and observer not in (str(o.observer_id), o.name):
                return
            if json_lines:
                if verdict.deliver:
                    show(as_json(verdict))
                return
            if verdict.gap:
                first, last = verdict.gap
                show(f"gap: {verdict.output.name} seq {first}..{last} never arrived")
            if verdict.deliver:
                show(line(verdict))

        with broker_errors():
            await queue.consume(on_message, no_ack=True)
        await stop.wait()
    finally:
        await connection.close()
    return reader
