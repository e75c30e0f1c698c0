"""Where the leader places work, against the real database and broker: a service counts for
directed starts and rebalance moves only while its control queue exists (a lease alone does not
say a message sent to it arrives), and rounds go on after moves that never reached their
target."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import secrets
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from urllib.parse import urlsplit

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractConnection, AbstractQueue

from orch.cluster import wait_for
from orch_contracts.errors import BrokerUnavailable
from orch_contracts.messages import (
    CONTROL_MESSAGE,
    AnyControl,
    DirectedStart,
    HandoffMessage,
    StartMessage,
)
from orch_contracts.routing import WORK
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import Topology
from orch_manager.background import Audit
from orch_manager.metrics import ManagerMetrics
from orch_manager.outbox import Outbox
from orch_manager.publisher import Publisher
from orch_manager.rebalance import Rebalancer
from orch_manager.store import ManagerStore
from orch_verify.proxy import Proxy, via
from tests.conftest import Servers
from tests.support.faults import memory_alarm


@pytest.fixture
async def publisher(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[Publisher]:
    p = Publisher(
        CommonSettings(database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix)
    )
    await p.start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def services_connection(servers: Servers) -> AsyncIterator[AbstractConnection]:
    """The broker connection the services' processes would hold their control queues on."""
    connection = await aio_pika.connect(servers.amqp_url)
    async with connection:
        yield connection


async def join_broker(connection: AbstractConnection, prefix: str, sid: uuid.UUID) -> AbstractQueue:
    """A service's control queue, declared as its process does: exclusive to its connection."""
    channel = await connection.channel()
    return await channel.declare_queue(
        Topology(prefix).control_queue(sid), exclusive=True, auto_delete=True
    )


async def received(queue: AbstractQueue, expect: int = 0) -> list[AnyControl]:
    """What the queue holds; with ``expect``, waits (5 s at most) until that many have come:
    the leader publishes its messages after its transaction, in the background."""
    out: list[AnyControl] = []

    async def enough() -> bool:
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            out.append(CONTROL_MESSAGE.validate_json(message.body))
        return len(out) >= expect

    with contextlib.suppress(TimeoutError):
        await wait_for(enough, timeout=5, what=f"{expect} control messages")
    return out


async def service(conn: asyncpg.Connection, worker_count: int) -> uuid.UUID:
    """A service row with a live lease, registered an hour ago."""
    sid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, created_at) "
        "VALUES ($1, $2, $3, $4, now() + interval '1 minute', now() - interval '1 hour')",
        sid,
        f"s-{sid}",
        worker_count,
        secrets.randbits(63),
    )
    return sid


async def observers(conn: asyncpg.Connection, n: int, holder: uuid.UUID | None) -> list[uuid.UUID]:
    """Processing observers held by ``holder`` (None: by nobody, dispatched long ago)."""
    out: list[uuid.UUID] = []
    for _ in range(n):
        oid = uuid.uuid4()
        await conn.execute(
            "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch, "
            "started_at, dispatched_at, modified_at) VALUES ($1, $2, 'ticker', 'processing', $3, "
            "$4, 1, CASE WHEN $4::uuid IS NULL THEN NULL ELSE now() END, "
            "now() - interval '1 minute', now() - interval '1 minute')",
            oid,
            f"o-{oid}",
            uuid.uuid4(),
            holder,
        )
        out.append(oid)
    return out


def audit(
    store: ManagerStore, publisher: Publisher, grace: float = 0.5, directed: float = 5.0
) -> Audit:
    return Audit(
        store,
        Outbox(store, publisher),
        publisher,
        grace=grace,
        margin=1.0,
        metrics=ManagerMetrics(),
        patience=5.0,
        directed=directed,
    )


def rebalancer(
    store: ManagerStore,
    publisher: Publisher,
    *,
    min_age: float = 0.0,
    landing: float = 10.0,
    tolerance: float = 0.0,
) -> Rebalancer:
    return Rebalancer(
        store,
        Outbox(store, publisher),
        publisher,
        pace=1.0,
        min_age=min_age,
        cooldown=600.0,
        landing=landing,
        metrics=ManagerMetrics(),
        tolerance=tolerance,
    )


async def handoffs_to(conn: asyncpg.Connection, target: uuid.UUID) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM observer_events WHERE event = 'handoff requested' "
            "AND detail LIKE '%to ' || $1",
            str(target),
        )
    )


async def test_directed_starts_go_only_to_services_whose_control_queue_exists(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Both leases are live; the service with more room has no control queue (its broker link
    is cut). Its starts would bounce to the work queue: they go to the other one, and what the
    other has no room for goes to the work queue."""
    conn, store = db
    on = await service(conn, worker_count=5)
    off = await service(conn, worker_count=20)
    queue = await join_broker(services_connection, prefix, on)
    stuck = await observers(conn, 6, holder=None)
    assert await audit(store, publisher).once() == 6
    routes = await conn.fetch("SELECT route, service_id FROM outbox")
    assert sorted((r["route"], r["service_id"]) for r in routes) == sorted(
        [("service", on)] * 5 + [("work", None)]
    ), f"placed by the lease alone (on={on}, off={off})"
    got = await received(queue, expect=5)
    assert len(got) == 5
    assert all(isinstance(m, DirectedStart) for m in got)
    assert {m.observer_id for m in got if isinstance(m, DirectedStart)} < set(stuck)
    assert await wait_for(publisher.work_queue_ready, timeout=5, what="the work queue's start")
    assert await publisher.work_queue_ready() == 1


@pytest.mark.parametrize(
    "weak", ["rejoined_at = now()", "stalled_since = now()"], ids=["rejoined", "stalled"]
)
async def test_directed_starts_avoid_a_service_that_does_not_keep_its_lease(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
    weak: str,
) -> None:
    """Both leases are live and both control queues exist, but the service with more room just
    came back from a lost lease (or its kind code blocks its loop): it gets no directed start
    and no move until it has kept its lease a while, while another has room. Once none has,
    the one back from a lost lease is the last resort before the work queue (a directed
    start is also read from the database: an alarm does not hold it); one whose loop is
    blocked never is. The work queue stays open to both."""
    conn, store = db
    good = await service(conn, worker_count=5)
    flaky = await service(conn, worker_count=20)
    await conn.execute(f"UPDATE services SET {weak} WHERE id = $1", flaky)
    await join_broker(services_connection, prefix, good)
    flaky_queue = await join_broker(services_connection, prefix, flaky)
    await observers(conn, 6, holder=None)
    assert await audit(store, publisher).once() == 6
    routes = await conn.fetch("SELECT route, service_id FROM outbox")
    last = ("service", flaky) if weak.startswith("rejoined") else ("work", None)
    assert sorted((r["route"], r["service_id"]) for r in routes) == sorted(
        [("service", good)] * 5 + [last]
    ), f"placed on a service that does not keep its lease (good={good}, flaky={flaky})"
    if last[1] != flaky:
        assert await received(flaky_queue) == []
    await observers(conn, 4, holder=good)
    assert await rebalancer(store, publisher, min_age=30).once() == 0, "moved work to it"
    assert await handoffs_to(conn, flaky) == 0


async def test_rebalance_moves_nothing_to_a_service_without_a_control_queue(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    conn, store = db
    donor = await service(conn, worker_count=10)
    cut = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, donor)
    await observers(conn, 6, holder=donor)
    r = rebalancer(store, publisher)
    assert await r.once() == 0, "planned moves to a service the broker cannot reach"
    assert await handoffs_to(conn, cut) == 0
    await join_broker(services_connection, prefix, cut)
    assert await r.once() == 3, "its control queue is back: it receives its share"
    assert await handoffs_to(conn, cut) == 3
    # Each move is recorded on its row with its message: what the holder checks before it
    # hands over (a handoff published by anyone else is not recorded there).
    recorded = await conn.fetch("SELECT handoff_to FROM observers WHERE service_id = $1", donor)
    assert sorted(str(r["handoff_to"]) for r in recorded) == sorted([str(cut)] * 3 + ["None"] * 3)


async def _donor_and_target(
    conn: asyncpg.Connection, services_connection: AbstractConnection, prefix: str
) -> tuple[uuid.UUID, uuid.UUID]:
    """Two services of 10 workers, both on the broker."""
    pair = (await service(conn, worker_count=10), await service(conn, worker_count=10))
    for sid in pair:
        await join_broker(services_connection, prefix, sid)
    return pair


async def _started(conn: asyncpg.Connection, ids: list[uuid.UUID], ago: timedelta) -> None:
    await conn.execute(
        "UPDATE observers SET started_at = now() - $2::interval WHERE id = ANY($1)",
        ids,
        ago,
    )


async def test_rebalance_does_not_move_an_observer_that_has_just_started(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Observers moved off a dead service are the newest on their new holders, and the rebalance
    picks the newest first: it moved them again a moment later, a second gap in a row. It now
    picks among those that started before its minimum age."""
    conn, store = db
    donor, target = await _donor_and_target(conn, services_connection, prefix)
    settled = await observers(conn, 3, holder=donor)
    await _started(conn, settled, timedelta(hours=1))
    await observers(conn, 5, holder=donor)  # just started here
    r = rebalancer(store, publisher, min_age=30.0)
    assert await r.once() == 3, "of the 4 planned moves, only the 3 settled observers may go"
    moved = await conn.fetch("SELECT id FROM observers WHERE handoff_to = $1", target)
    assert {m["id"] for m in moved} == set(settled)


async def test_rebalance_moves_the_observers_longest_without_a_move(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Each move costs its observer a gap: the rebalance picks those that went longest
    without one, not the newest past the minimum age. Picking the newest, a round after five
    crashes' recovery moved 1,057 of the 25,000 just-moved observers a second time, and a new
    leader (its predecessor's cooldown forgotten) would pick what its predecessor moved."""
    conn, store = db
    donor, target = await _donor_and_target(conn, services_connection, prefix)
    old = await observers(conn, 2, holder=donor)
    await _started(conn, old, timedelta(days=1))
    moved_lately = await observers(conn, 4, holder=donor)
    await _started(conn, moved_lately, timedelta(minutes=1))
    r = rebalancer(store, publisher, min_age=30.0)
    assert await r.once() == 3, "3 moves planned, each finds a settled observer"
    moved = {
        m["id"] for m in await conn.fetch("SELECT id FROM observers WHERE handoff_to = $1", target)
    }
    assert set(old) <= moved, "an observer just moved went before one running for a day"


async def test_a_new_leader_leaves_a_fleet_within_the_tolerance_alone(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """A leader starts with none of its predecessor's memory (its cooldown, its moves): at
    fleet size, the new leader after a kill moved up to 678 observers to even out a few
    percent. Nor does a recovery's last unevenness move what it just moved: 333 of 25,000
    observers moved off five dead services were moved again."""
    conn, store = db
    a = await service(conn, worker_count=10)
    b = await service(conn, worker_count=10)
    for sid in (a, b):
        await join_broker(services_connection, prefix, sid)
    await observers(conn, 41, holder=a)
    await observers(conn, 39, holder=b)  # shares of 40: 2.5 % off
    r = rebalancer(store, publisher, tolerance=0.05)
    assert await r.once() == 0, "moved observers of a fleet within 5 % of its shares"
    await observers(conn, 4, holder=a)  # 45 and 39, shares of 42: 7 % off
    assert await r.once() == 3, "a service outside the band: the shares are met exactly"


async def test_rebalance_waits_while_a_dead_services_observers_move(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Loads half-way through a recovery are not a fleet to even out: a round then moved the
    observers just moved off the dead services a second time."""
    conn, store = db
    donor = await service(conn, worker_count=10)
    target = await service(conn, worker_count=10)
    dead = await service(conn, worker_count=10)
    for sid in (donor, target):
        await join_broker(services_connection, prefix, sid)
    await observers(conn, 6, holder=donor)
    orphan = await observers(conn, 1, holder=dead)
    await conn.execute("UPDATE services SET is_deleted = true WHERE id = $1", dead)
    r = rebalancer(store, publisher)
    assert await r.once() == 0, "a round ran while a dead service's observer was still to move"
    await conn.execute("UPDATE observers SET service_id = $1 WHERE id = ANY($2)", target, orphan)
    assert await r.once() > 0, "the recovery over, the round runs"


async def test_min_age_counts_from_the_control_queue_reappearing(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """An hour old by its row, but back on the broker for less than the minimum age: no moves
    yet (a service whose broker link flaps is a flapping service)."""
    conn, store = db
    donor = await service(conn, worker_count=10)
    healed = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, donor)
    await observers(conn, 6, holder=donor)
    r = rebalancer(store, publisher, min_age=1.0)
    assert await r.once() == 0
    await join_broker(services_connection, prefix, healed)
    assert await r.once() == 0, "moves to a service back on the broker a moment ago"
    await asyncio.sleep(1.0)
    assert await r.once() == 3
    assert await handoffs_to(conn, healed) == 3


async def test_rounds_go_on_after_moves_that_never_landed(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """The donor released the moved observers but their starts never reached the target (lost
    with a control queue that went away): the next round waits for them, not forever."""
    conn, store = db
    donor, _ = await _donor_and_target(conn, services_connection, prefix)
    await observers(conn, 6, holder=donor)
    r = rebalancer(store, publisher, landing=0.5)
    assert await r.once() == 3
    await conn.execute(
        "UPDATE observers SET service_id = NULL WHERE id IN (SELECT observer_id FROM "
        "observer_events WHERE event = 'handoff requested')"
    )
    assert await r.once() == 0, "the moves are between holders: the round waits"
    await asyncio.sleep(0.5)
    assert await r.once() > 0, "a round waited for moves that cannot land any more"


async def test_a_move_given_up_on_leaves_no_record_on_its_row(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """A recorded move is what a holder hands over on; one the leader forgot (its handoff never
    came through) must not wait on the row for a handoff that anyone could send later."""
    conn, store = db
    donor = await service(conn, worker_count=10)
    target = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, donor)
    off = await join_broker(services_connection, prefix, target)
    await observers(conn, 6, holder=donor)
    r = rebalancer(store, publisher, landing=0.2)
    assert await r.once() == 3
    recorded = "SELECT count(*) FROM observers WHERE handoff_to IS NOT NULL"
    assert await conn.fetchval(recorded) == 3
    await off.delete()  # the target leaves the broker: the next round plans nothing
    await asyncio.sleep(0.2)
    assert await r.once() == 0
    assert await conn.fetchval(recorded) == 0


async def test_a_handoff_that_did_not_reach_its_target_puts_no_cooldown(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Each round's handoff comes to nothing (dropped, or bounced back to the work queue and
    taken by the donor again): the observer stays where it was. Were it under the cooldown
    anyway, the donor would soon have nothing left to give, and the target would get nothing
    for the whole cooldown (the partitioned service of the incident)."""
    conn, store = db
    donor = await service(conn, worker_count=10)
    target = await service(conn, worker_count=10)
    queue = await join_broker(services_connection, prefix, donor)
    await join_broker(services_connection, prefix, target)
    await observers(conn, 2, holder=donor)
    r = rebalancer(store, publisher, landing=0.2)
    for round_ in range(3):
        assert await r.once() == 1, f"round {round_ + 1} moved nothing"
        await asyncio.sleep(0.2)
    got = await received(queue, expect=3)
    assert len(got) == 3
    assert all(isinstance(m, HandoffMessage) and m.to == target for m in got)


async def test_the_audit_waits_longer_each_time_it_re_dispatches_an_observer(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """A service slower than the grace to take a burst of directed starts must not see every
    burst made stale by the next (a thousand moved, re-dispatched every 0.8 s for 100 s). The
    same stuck observers are re-dispatched again only after twice the grace, then four times."""
    conn, store = db
    sid = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, sid)
    stuck = await observers(conn, 3, holder=None)
    grace = 0.2
    leader = audit(store, publisher, grace=grace)

    async def untaken_for_long() -> None:
        """As if the starts sent were never taken, however long ago they went."""
        await leader.box.delete_published()  # as every manager does in the background
        await conn.execute(
            "UPDATE observers SET dispatched_at = now() - interval '1 minute', "
            "modified_at = now() - interval '1 minute' WHERE id = ANY($1)",
            stuck,
        )

    async def next_redispatch() -> tuple[float, float]:
        """When the call that re-dispatched them again began, and when it returned."""
        while True:
            await untaken_for_long()
            began = time.monotonic()
            if await leader.once():
                return began, time.monotonic()
            assert began - first < 10, "never re-dispatched again"
            await asyncio.sleep(0.02)

    # The audit reads its clock inside each call: a re-dispatch in a call that ended at E
    # follows the one in a call that began at B by at most E - B (reading the same clock at
    # the calls' edges was 0.1 ms short once in CI).
    first = time.monotonic()
    assert await leader.once() == 3
    second, second_end = await next_redispatch()
    _, third_end = await next_redispatch()
    waited = second_end - first
    assert waited >= 2 * grace, f"re-dispatched again within {waited:.2f}s"
    waited = third_end - second
    assert waited >= 4 * grace, f"re-dispatched a third time within {waited:.2f}s"


async def test_the_audit_leaves_alone_what_a_live_service_is_taking(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """Takes that last seconds (a slow database link) reported by the service's renewal: the
    audit sends none of those starts anew (each cost that link a round trip to drop as stale),
    but sends the others', and those of a service whose lease has expired."""
    conn, store = db
    sid = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, sid)
    taken, lost = await observers(conn, 2, holder=None), await observers(conn, 1, holder=None)
    await conn.execute("UPDATE services SET taking = $1 WHERE id = $2", taken, sid)
    assert await audit(store, publisher).once() == 1
    sent = "SELECT observer_id FROM observer_events WHERE event = 'redispatched'"
    assert [r["observer_id"] for r in await conn.fetch(sent)] == lost
    await conn.execute("UPDATE services SET lease_expires_at = now() WHERE id = $1", sid)
    assert await audit(store, publisher).once() == 2


async def test_the_audit_leaves_a_start_directed_to_a_live_service_to_it(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """A move's donor released its observers towards their target (``directed_to``) 0.6 s ago,
    and a host-wide stall kept the target from taking them yet. A start sent anew would make
    the handoff's start on its way stale (a soak's move took 1.04 s so): the audit leaves them
    to the target for ``directed`` seconds, which its renewal covers if the message was lost.
    One directed to a service whose lease ended, or directed longer ago, is sent anew."""
    conn, store = db
    target = await service(conn, worker_count=10)
    gone = await service(conn, worker_count=10)
    await join_broker(services_connection, prefix, target)
    moving = await observers(conn, 2, holder=None)
    stranded = await observers(conn, 1, holder=None)
    await conn.execute(
        "UPDATE observers SET directed_to = $2, modified_at = now() - interval '0.6 seconds' "
        "WHERE id = ANY($1)",
        moving + stranded,
        target,
    )
    await conn.execute("UPDATE observers SET directed_to = $2 WHERE id = ANY($1)", stranded, gone)
    await conn.execute("UPDATE services SET lease_expires_at = now() WHERE id = $1", gone)
    assert await audit(store, publisher, directed=3.0).once() == 1
    sent = "SELECT observer_id FROM observer_events WHERE event = 'redispatched'"
    assert [r["observer_id"] for r in await conn.fetch(sent)] == stranded
    await conn.execute(
        "UPDATE observers SET modified_at = now() - interval '4 seconds' WHERE id = ANY($1)",
        moving,
    )
    assert await audit(store, publisher, directed=3.0).once() == 2


async def test_the_audit_places_stuck_observers_through_the_database_while_the_broker_is_away(
    db: tuple[asyncpg.Connection, ManagerStore], servers: Servers, database_url: str, prefix: str
) -> None:
    """The manager cannot reach the broker (restarted, cut off): the audit still places the
    observers nobody holds, each directed to a live service with room, which reads its
    directed start from the database at its next renewal. It gave up instead (its first
    question went to the broker), and a chaos run's observers waited 10.6 s for the broker and
    the publisher to come back."""
    conn, store = db
    parts = urlsplit(servers.amqp_url)
    proxy = await Proxy(parts.hostname or "127.0.0.1", parts.port or 5672).start()
    away = Publisher(
        CommonSettings(
            database_url=database_url, amqp_url=via(servers.amqp_url, proxy), prefix=prefix
        )
    )
    await away.start()
    try:
        sid = await service(conn, worker_count=10)
        stuck = await observers(conn, 2, holder=None)
        proxy.refuse()
        proxy.reset()
        await wait_for(
            lambda: asyncio.sleep(0, not away.connected), timeout=10, what="the broker gone"
        )
        assert await audit(store, away).once() == 2
        rows = await conn.fetch("SELECT directed_to FROM observers WHERE id = ANY($1)", stuck)
        assert [r["directed_to"] for r in rows] == [sid, sid]
    finally:
        await away.close()
        await proxy.close()


async def test_the_audit_finds_lost_starts_whatever_else_the_work_queue_holds(
    db: tuple[asyncpg.Connection, ManagerStore], publisher: Publisher, prefix: str
) -> None:
    """A few starts ready in the work queue (nobody consumes it) must not turn recovery off: the
    observers whose start is nowhere are re-dispatched all the same."""
    conn, store = db
    stuck = await observers(conn, 3, holder=None)
    connection = await aio_pika.connect(publisher.settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        for _ in range(2):  # two starts nobody takes
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}"), routing_key=Topology(prefix).work_queue
            )
    assert await publisher.work_queue_ready() == 2
    assert await audit(store, publisher).once() == 3
    moved = await conn.fetchval(
        "SELECT count(*) FROM observer_events WHERE event = 'redispatched' "
        "AND observer_id = ANY($1)",
        stuck,
    )
    assert moved == len(stuck)


async def test_the_leaders_questions_keep_no_memory(
    publisher: Publisher, services_connection: AbstractConnection, prefix: str
) -> None:
    """Each question opens a channel the broker may close. Asked on aio-pika's channels, each
    left about 2 KiB on the connection for good (a callback its close never took off): the
    leader, asking the work queue's count four times a second, grew 58 MiB an hour in a soak.
    A thousand questions of each sort now leave nothing that stays."""
    here, gone = uuid.uuid4(), uuid.uuid4()
    await join_broker(services_connection, prefix, here)

    async def ask(n: int) -> None:
        for _ in range(n):
            await publisher.work_queue_counts()
            assert await publisher.service_present(here)
            assert not await publisher.service_present(gone)

    await ask(50)  # caches, channel numbers, the first of everything
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await ask(1000)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 3000 * 200, f"{kept / 3000:.0f} bytes kept a question"


async def test_a_start_returned_by_a_deleted_work_queue_is_kept_and_lands_when_retried(
    publisher: Publisher, services_connection: AbstractConnection, prefix: str
) -> None:
    """A start published while the work queue is deleted comes back (mandatory): it is not
    counted as delivered (the outbox keeps it), and the queue is declared again so that the
    retry lands."""
    channel = await services_connection.channel()
    await channel.queue_delete(Topology(prefix).work_queue)
    start = StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4())
    with pytest.raises(BrokerUnavailable):
        await publisher.deliver(WORK, start)
    await publisher.deliver(WORK, start)
    assert await publisher.work_queue_ready() == 1


async def test_a_publisher_whose_reconnect_dies_tells_its_owner(
    servers: Servers, database_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug met while connecting again must not leave a manager that never publishes again
    and never exits: the owner is told (the manager's runtime then stops the process)."""
    died: asyncio.Queue[asyncio.Task[None]] = asyncio.Queue()
    p = Publisher(
        CommonSettings(database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix),
        died=died.put_nowait,
    )
    await p.start()
    try:

        async def broken_open() -> None:
            raise RuntimeError("a bug in connecting")

        monkeypatch.setattr(p, "_open", broken_open)
        assert p._connection is not None
        await p._connection.close()  # the broker connection is lost: it connects again
        task = await asyncio.wait_for(died.get(), 5)
        assert isinstance(task.exception(), RuntimeError)
        assert task.get_name() == "broker-reconnect"
    finally:
        await p.close()


async def test_probes_at_once_of_absent_services_leave_the_connection_open(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe of a service that is gone closes its channel (the broker answers "not found").
    aiormq frees that channel's number before it confirms the close, and gave it to the next
    probe's channel: the broker then closed the manager's whole connection ("second
    'channel.open' seen"). Forty probes at a time lost it in 43-50 rounds of 100. Probe
    channels now take numbers in turn from a range of their own."""
    caplog.set_level(logging.WARNING, logger="orch_manager.publisher")
    ids = [uuid.uuid4() for _ in range(40)]
    for _ in range(30):
        assert set(await asyncio.gather(*(publisher.service_present(i) for i in ids))) == {False}
    lost = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    assert not lost, lost


async def test_probes_cut_short_by_their_timeout_leave_the_connection_open(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    """On a loaded fleet the leader's probes of the services' control queues timed out, and
    each timeout cancelled a channel's open midway: the broker then closed the manager's whole
    connection ("second 'channel.open' seen"), 831 times in 12 minutes, and every start,
    handoff and probe waited on a reconnect. Here twenty probes at a time are cut short by
    timeouts of a few milliseconds, 32 rounds: the connection is never lost."""
    caplog.set_level(logging.WARNING, logger="orch_manager.publisher")
    ids = [uuid.uuid4() for _ in range(20)]
    for timeout in [0.0005, 0.001, 0.002, 0.005] * 8:
        publisher.probe_timeout = timeout
        await asyncio.gather(*(publisher.service_present(i) for i in ids), return_exceptions=True)
    publisher.probe_timeout = 5.0
    assert await publisher.service_present(ids[0]) is False  # the connection still answers
    lost = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    assert not lost, lost


async def test_the_audit_sends_anew_an_unpublished_start_only_to_a_service(
    db: tuple[asyncpg.Connection, ManagerStore],
    publisher: Publisher,
    services_connection: AbstractConnection,
    prefix: str,
) -> None:
    """A start stuck in the outbox (an alarm held the publishers long past the audit's grace)
    is sent anew only where a service reads it from the database too: one more start for the
    work queue would only wait behind the first, and the outbox would grow each round."""
    conn, store = db
    stuck = await observers(conn, 2, holder=None)
    for oid in stuck:
        await conn.execute(
            "INSERT INTO outbox (route, body, created_at) VALUES ('work', $1::jsonb, "
            "now() - interval '1 hour')",
            json.dumps({"observer_id": str(oid), "dispatch_id": str(uuid.uuid4())}),
        )
    before = await dispatches(conn, stuck)
    await audit(store, publisher).once()
    assert await dispatches(conn, stuck) == before, "sent anew to the work queue"
    on = await service(conn, worker_count=5)
    await join_broker(services_connection, prefix, on)
    await audit(store, publisher).once()
    after = await dispatches(conn, stuck)
    assert all(after[o] != before[o] for o in stuck), "not sent to the service with room"
    routes = await conn.fetch(
        "SELECT route, service_id FROM outbox WHERE created_at > now() - interval '1 minute'"
    )
    assert [(r["route"], r["service_id"]) for r in routes] in ([], [("service", on)] * 2)


async def dispatches(conn: asyncpg.Connection, ids: list[uuid.UUID]) -> dict[uuid.UUID, uuid.UUID]:
    rows = await conn.fetch("SELECT id, dispatch_id FROM observers WHERE id = ANY($1)", ids)
    return {r["id"]: r["dispatch_id"] for r in rows}


@pytest.mark.alone
async def test_the_leaders_questions_are_answered_while_the_broker_blocks_its_publishes(
    publisher: Publisher, services_connection: AbstractConnection, prefix: str
) -> None:
    """A memory alarm blocks a connection once it publishes, and then all it sends: the
    leader's questions (is a service on the broker, how many starts wait) go on a connection
    that publishes nothing, and are answered through the alarm."""
    sid = uuid.uuid4()
    await join_broker(services_connection, prefix, sid)
    start = StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4())
    with memory_alarm():
        with contextlib.suppress(BrokerUnavailable):  # blocked, or refused as blocked
            await publisher.deliver(WORK, start)

        async def blocked() -> bool:
            return publisher.blocked

        await wait_for(blocked, timeout=10, what="the broker to block the publisher")
        async with asyncio.timeout(5):
            assert await publisher.service_present(sid)
            assert await publisher.work_queue_ready() >= 0
