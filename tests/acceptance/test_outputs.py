"""What observers emit, judged from what a plain consumer receives: a queue of the test's own
bound to ``<prefix>.outputs``, read with aio-pika alone.

The ``emitter`` kind counts n on from its checkpoint and emits ``{"n": n}``: end to end, the
consumer must see every seq from 1 once (after dropping repeated ``message_id``s), no gap, no
record of an older epoch after a newer epoch's first, and n equal to seq: the records a copy
staged and never committed were never delivered, and the next copy emitted them again under
the same seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest

from orch_contracts.outputs import Output
from tests.support.cluster import Cluster, wait_for


@dataclass
class Received:
    outputs: list[Output] = field(default_factory=list)
    message_ids: list[str] = field(default_factory=list)
    routing_keys: set[str] = field(default_factory=set)

    def of(self, observer: uuid.UUID) -> dict[int, Output]:
        """Per seq, the first copy received of each."""
        out: dict[int, Output] = {}
        for o in self.outputs:
            if o.observer_id == observer:
                out.setdefault(o.seq, o)
        return out


@contextlib.asynccontextmanager
async def consumer(cluster: Cluster) -> AsyncIterator[Received]:
    """A queue of our own, bound to every kind, declared before anything is emitted."""
    got = Received()
    connection = await aio_pika.connect(cluster.amqp_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            f"{cluster.prefix}.outputs", aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, routing_key="#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.outputs.append(Output.from_message(message.body, dict(message.headers)))
            got.message_ids.append(str(message.message_id))
            got.routing_keys.add(message.routing_key or "")
            await message.ack()

        await queue.consume(on_message)
        yield got
    finally:
        await connection.close()


async def emitters(cluster: Cluster, n: int, **params: Any) -> list[uuid.UUID]:
    ids = []
    for i in range(n):
        body = await cluster.create(f"emit-{i}", "emitter", **params)
        ids.append(uuid.UUID(body["id"]))
    return ids


async def settled(cluster: Cluster, got: Received, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    """Wait until nothing is left in the outbox and the consumer has every committed seq;
    returns each observer's last committed seq."""

    state = {"left": -1, "missing": {}}

    async def drained() -> bool:
        left = await cluster.q("SELECT count(*) AS n FROM observer_outputs")
        rows = await cluster.q("SELECT id, output_seq FROM observers WHERE id = ANY($1)", ids)
        state["left"] = left[0]["n"]
        state["missing"] = {
            str(r["id"]): sorted(set(range(1, r["output_seq"] + 1)) - set(got.of(r["id"])))[:5]
            for r in rows
            if len(got.of(r["id"])) < r["output_seq"]
        }
        return not state["left"] and not state["missing"]

    try:
        await wait_for(drained, timeout=20, what="every committed output received")
    except TimeoutError as exc:
        raise AssertionError(f"not every committed output arrived: {state}") from exc
    rows = await cluster.q("SELECT id, output_seq FROM observers WHERE id = ANY($1)", ids)
    return {r["id"]: r["output_seq"] for r in rows}


def judge(got: Received, last: dict[uuid.UUID, int]) -> None:
    for oid, top in last.items():
        records = got.of(oid)
        assert top > 0, f"{oid} committed nothing"
        assert sorted(records) == list(range(1, top + 1)), f"{oid}: gaps or extra seqs"
        assert [records[s].record["n"] for s in sorted(records)] == sorted(records), (
            f"{oid}: a record's n is not its seq (delivered twice or lost across copies)"
        )
        epochs = [records[s].epoch for s in sorted(records)]
        assert epochs == sorted(epochs), f"{oid}: an older epoch's record after a newer one's"
        # Per observer, what arrived first arrived in seq order (repeats aside).
        first_seen: list[int] = []
        for o in got.outputs:
            if o.observer_id == oid and o.seq not in first_seen:
                first_seen.append(o.seq)
        assert first_seen == sorted(first_seen), f"{oid}: records out of order"


async def test_emitted_records_reach_a_plain_consumer_in_order_with_their_headers(
    cluster: Cluster,
) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=10)
    async with consumer(cluster) as got:
        ids = await emitters(cluster, 3, interval=0.01, per_tick=3, checkpoint_every=2)
        await wait_for(
            lambda: asyncio.sleep(0, result=all(len(got.of(i)) >= 60 for i in ids)),
            timeout=20,
            what="60 records each",
        )
        rows = await cluster.q("SELECT id, name, epoch FROM observers WHERE id = ANY($1)", ids)
        names = {r["id"]: r["name"] for r in rows}
        first = got.outputs[0]
        assert got.routing_keys == {"emitter"}
        assert first.kind == "emitter"
        assert first.name == names[first.observer_id]
        assert got.message_ids[0] == f"{first.observer_id}:{first.seq}"
        assert first.committed_at <= time.time()
        # The page of an observer shows its last committed seq.
        async with cluster.api() as api:
            shown = (await api.get(f"/observers/{ids[0]}")).json()
        assert shown["output_seq"] >= 60
        judge(got, await _stop_and_settle(cluster, got, ids))


async def _stop_and_settle(
    cluster: Cluster, got: Received, ids: list[uuid.UUID]
) -> dict[uuid.UUID, int]:
    """Delete the emitters (nothing more is committed), then wait for what was."""
    async with cluster.api() as api:
        for oid in ids:
            assert (await api.delete(f"/observers/{oid}")).status_code in (200, 202)
    for oid in ids:
        await cluster.wait_status(oid, "deleted", timeout=15)
    return await settled(cluster, got, ids)


@pytest.mark.processes
@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_after_a_crash_or_a_freeze_past_the_lease_every_seq_arrives_once(
    cluster: Cluster, fault: str
) -> None:
    """SIGKILL, or SIGSTOP past the lease, of the service running the emitters while they
    emit: the consumer sees no gap, no stale epoch after a newer one, and n == seq (records
    between the last checkpoint and the fault were never delivered, and were emitted again)."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    async with consumer(cluster) as got:
        ids = await emitters(cluster, 8, interval=0.01, per_tick=2, checkpoint_every=3)
        await wait_for(
            lambda: asyncio.sleep(0, result=all(len(got.of(i)) >= 30 for i in ids)),
            timeout=20,
            what="30 records each",
        )
        b = await cluster.start_service("b", worker_count=20)
        b_id = await cluster.service_id(b)
        at = time.time()
        if fault == "kill":
            a.signal(signal.SIGKILL)
            await cluster.wait_all_running(
                ids, timeout=cluster.lease_ttl + 10, on={b_id}, fresh_after=at
            )
        else:
            async with cluster.frozen(a):
                await cluster.wait_all_running(
                    ids, timeout=cluster.lease_ttl + 10, on={b_id}, fresh_after=at
                )
        before = {i: len(got.of(i)) for i in ids}
        await wait_for(
            lambda: asyncio.sleep(0, result=all(len(got.of(i)) >= before[i] + 30 for i in ids)),
            timeout=20,
            what="30 more records each from the new copies",
        )
        last = await _stop_and_settle(cluster, got, ids)
    judge(got, last)
    # Every observer moved: its records carry both epochs.
    for oid in ids:
        assert len({o.epoch for o in got.of(oid).values()}) >= 2, f"{oid} did not move"


async def test_a_kind_with_commit_every_delivers_without_checkpoints(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=10)
    async with consumer(cluster) as got:
        body = await cluster.create("auto", "auto_emitter", interval=0.005, per_tick=2)
        oid = uuid.UUID(body["id"])
        await wait_for(
            lambda: asyncio.sleep(0, result=len(got.of(oid)) >= 200),
            timeout=20,
            what="200 records committed on their own",
        )
        row = await cluster.observer(oid)
        assert row["checkpoint"] is None  # no checkpoint was ever written
        records = got.of(oid)
        assert sorted(records)[:200] == list(range(1, 201))


async def test_a_copy_that_commits_nothing_is_restarted_for_no_progress(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=10)
    oid = uuid.UUID((await cluster.create("quiet", "silent"))["id"])

    async def restarted() -> bool:
        row = await cluster.observer(oid)
        runs = json.loads(row["checkpoint"] or "{}").get("runs", 0)
        return int(row["restart_count"]) >= 2 and runs >= 3  # each run began anew

    await wait_for(restarted, timeout=20, what="two restarts for no progress")
    row = await cluster.observer(oid)
    assert "no progress for 1 s" in (row["last_error"] or "")
