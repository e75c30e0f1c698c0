"""The outbox keeps the trace context a message was written in: a start the relay publishes
late (the broker was away when its request committed) is published in its request's trace."""

from __future__ import annotations

import asyncpg

from orch_contracts.messages import StartMessage
from orch_contracts.routing import Route
from orch_manager import repository as repo
from orch_manager.store import ManagerStore


async def test_an_outbox_row_gives_the_relay_the_trace_it_was_written_in(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    conn, store = db
    context = {"traceparent": "00-" + "c" * 32 + "-" + "d" * 16 + "-01", "tracestate": "v=1"}
    async with store.autocommit() as tx:
        rows, written = await repo.create_observers(
            tx,
            [
                repo.NewObserver("traced", "ticker", {}, trace=context),
                repo.NewObserver("untraced", "ticker", {}),
            ],
        )
    assert [p.trace for p in written] == [context, None]
    async with store.transaction() as tx:
        due = await repo.outbox_due(tx, grace=-1, limit=10, skip=[])
    by_observer = {p.message.observer_id: p for p in due if isinstance(p.message, StartMessage)}
    traced, untraced = (by_observer[r["id"]] for r in rows)  # type: ignore[index]
    assert traced.trace == context
    assert traced.to.route is Route.WORK
    assert untraced.trace is None
    stored = await conn.fetchval("SELECT count(*) FROM outbox WHERE trace IS NOT NULL")
    assert stored == 1
