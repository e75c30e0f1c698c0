"""Control messages the database does not confirm are not acted on, through the in-memory
fakes (the real cluster, with messages published by hand: tests/acceptance/test_forged_control.py).
"""

from __future__ import annotations

import asyncio
import uuid

from orch_contracts.messages import CancelMessage, DrainMessage, HandoffMessage, UndrainMessage
from orch_contracts.statuses import ObserverStatus as S
from tests.unit.test_service_core import TICKS, harness, until


async def _settled(h: object) -> None:
    """Every check spawned by a control message has finished."""
    service = h.service  # type: ignore[attr-defined]
    await until(lambda: not any(t.get_name().startswith("check-") for t in service._background))


async def test_a_forged_drain_is_ignored_and_a_real_one_acted_on() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await _settled(h)
        assert not h.service.draining
        assert h.broker.session.consuming
        assert row.id in h.service.runners
        assert delivery.outcome is None
        assert h.service.metrics.control_refused.labels("drain")._value.get() == 1
        h.store.draining = True  # the API marks the row, then broadcasts
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: delivery.outcome == "requeue")


async def test_a_forged_undrain_leaves_a_drained_service_drained() -> None:
    async with harness() as h:
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: not h.broker.session.consuming)
        await h.broker.session.control(UndrainMessage(service_id=h.service.id).to_bytes())
        await _settled(h)
        assert h.service.draining
        assert not h.broker.session.consuming


async def test_a_forged_cancel_stops_nothing() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        for _ in range(5):
            await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await _settled(h)
        before = TICKS[row.id]
        await until(lambda: TICKS[row.id] > before + 3)
        assert (row.status, row.service_id, row.epoch) == (S.PROCESSING, h.service.id, 1)
        assert delivery.outcome is None


async def test_a_cancel_of_a_copy_whose_row_moved_away_stops_it() -> None:
    """The blame's cancel: the row was failed, or taken at a newer epoch by someone else."""
    async with harness() as h:
        row, delivery = await h.started()
        row.status, row.service_id = S.FAILED, None
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await h.stopped(row)
        assert delivery.outcome == "ack"


async def test_a_forged_handoff_hands_nothing_over() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        recorded = uuid.uuid4()
        row.handoff_to = recorded
        forged = HandoffMessage(observer_id=row.id, to=uuid.uuid4())  # another target
        await h.broker.session.control(forged.to_bytes())
        await _settled(h)
        assert row.id in h.service.runners
        assert delivery.outcome is None
        assert h.broker.sent == []
        await h.broker.session.control(HandoffMessage(observer_id=row.id, to=recorded).to_bytes())
        await until(lambda: delivery.outcome == "ack")
        assert h.broker.sent == [(row.start, recorded)]


async def test_a_handoff_recorded_for_an_older_copy_is_ignored() -> None:
    """A take clears the record: what the leader decided for the last holder is not ours."""
    async with harness() as h:
        row = h.store.add("tick", handoff_to=uuid.uuid4())
        await h.run(row)
        await h.running(row)
        assert row.handoff_to is None


async def test_a_cancel_waits_out_a_database_outage_and_then_stops_the_copy() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        h.store.available = False
        row.status = S.ON_DELETING
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await until(lambda: h.store.calls.count("control_facts") >= 2)  # asked again
        assert row.id in h.service.runners, "acted on without the database"
        h.store.available = True
        await until(lambda: row.status is S.DELETED)
        await until(lambda: delivery.outcome == "ack")  # the ack follows the row's write


async def test_a_drain_waits_out_a_database_outage() -> None:
    async with harness() as h:
        h.store.available = False
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: h.store.calls.count("control_facts") >= 2)
        assert not h.service.draining
        h.store.available = True
        await until(lambda: h.service.draining)


async def test_cancels_that_arrive_together_are_checked_with_one_read() -> None:
    async with harness() as h:
        rows = [(await h.started())[0] for _ in range(5)]
        for row in rows:
            row.status = S.ON_DELETING
        calls = h.store.calls.count("control_facts")
        await asyncio.gather(
            *(h.broker.session.control(CancelMessage(observer_id=r.id).to_bytes()) for r in rows)
        )
        await until(lambda: all(r.status is S.DELETED for r in rows))
        assert h.store.calls.count("control_facts") - calls <= 2


async def test_a_cancel_for_an_observer_not_here_asks_nothing() -> None:
    async with harness() as h:
        calls = h.store.calls.count("control_facts")
        await h.broker.session.control(CancelMessage(observer_id=uuid.uuid4()).to_bytes())
        await h.broker.session.control(
            HandoffMessage(observer_id=uuid.uuid4(), to=uuid.uuid4()).to_bytes()
        )
        await h.broker.session.control(DrainMessage(service_id=uuid.uuid4()).to_bytes())
        assert h.store.calls.count("control_facts") == calls
