"""The service core's side of an undrain, and the broker advice given once, through the
in-memory fakes (the real cluster is in tests/acceptance/test_cli.py)."""

from __future__ import annotations

import logging

import pytest

from observer_service.ports import Renewal
from orch_contracts.messages import DrainMessage, UndrainMessage
from tests.unit.test_service_core import harness, until


async def test_an_undrained_service_consumes_and_runs_again() -> None:
    async with harness() as h:
        _row, delivery = await h.started()
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: delivery.outcome == "requeue")
        assert not h.broker.session.consuming
        h.store.draining = False
        await h.broker.session.control(UndrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: h.broker.session.consuming)
        assert not h.service.draining
        fresh = h.store.add("tick")
        await h.run(fresh)
        await h.running(fresh)
        assert fresh.service_id == h.service.id


async def test_an_undrain_for_another_service_changes_nothing() -> None:
    async with harness() as h:
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: not h.broker.session.consuming)
        other = UndrainMessage(service_id=h.store.add("tick").id)  # some other id
        await h.broker.session.control(other.to_bytes())
        assert h.service.draining
        assert not h.broker.session.consuming


async def test_a_renewal_that_read_the_old_flag_does_not_drain_again() -> None:
    async with harness() as h:
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: h.service.draining)
        h.store.draining = False
        await h.broker.session.control(UndrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: h.broker.session.consuming)
        await h.lease.renewals.put(Renewal(deleting=[], draining=True))  # read before it
        await until(lambda: h.lease.renewals.empty())
        assert not h.service.draining
        assert h.broker.session.consuming


async def test_a_missed_undrain_broadcast_is_made_up_for_by_a_renewal() -> None:
    """The row no longer says draining; no undrain message came: a renewal undrains it, once a
    lease's length has passed since the drain (one read before it may not)."""
    async with harness() as h:
        h.store.draining = True
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: not h.broker.session.consuming)
        h.store.draining = False  # the API undid it; its broadcast was lost
        await h.lease.renewals.put(Renewal(deleting=[], draining=False))
        await until(lambda: h.lease.renewals.empty())
        assert h.service.draining, "a renewal within a lease of the drain undrained it"
        await until(lambda: h.broker.session.consuming, timeout=3 * h.lease.timings.ttl)
        assert not h.service.draining


@pytest.mark.parametrize("advise", [True, False])
async def test_the_broker_advice_can_be_left_to_orch_up(
    advise: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.support import fakes

    real = fakes.FakeSession.__init__

    def old_broker(self: fakes.FakeSession, *args: object) -> None:
        real(self, *args)  # type: ignore[arg-type]
        self.version = (3, 11, 0)

    caplog.set_level(logging.WARNING)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fakes.FakeSession, "__init__", old_broker)
        async with harness(broker_advice=advise):
            pass
    warned = [r for r in caplog.records if "consumer_timeout" in r.getMessage()]
    assert len(warned) == (1 if advise else 0)
