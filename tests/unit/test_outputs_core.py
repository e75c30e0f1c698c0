"""Outputs through the service core and its in-memory fakes: seqs, commits with the checkpoint,
publishing in order after older commits, retries, backpressure, progress. The real database and
broker are in tests/acceptance/test_outputs.py."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from observer_service import outputs as outputs_module
from observer_service.context import ObserverContext
from observer_service.outputs import LIMIT, CopyOutputs, OutputBudget, TooManyStaged
from observer_service.ports import Checkpoint
from orch_contracts.errors import BrokerUnavailable
from orch_contracts.kinds import KindSpec, RestartPolicy
from orch_contracts.outputs import Committed
from tests.support.fakes import FakeSession
from tests.unit.test_service_core import KINDS, harness, until

EMITTED: dict[uuid.UUID, int] = {}
ERRORS: list[BaseException] = []


async def emits(ctx: ObserverContext) -> None:
    """Emits n counting on from its checkpoint, three a tick, and checkpoints every tick."""
    n = int((ctx.last_checkpoint or {}).get("n", 0))
    while True:
        for _ in range(3):
            n += 1
            await ctx.emit({"n": n})
        EMITTED[ctx.observer_id] = n
        await ctx.checkpoint({"n": n})
        await ctx.sleep(0.005)


async def emits_then_fails(ctx: ObserverContext) -> None:
    """Checkpoints 2 records, then stages 2 more and raises: those are never delivered."""
    n = int((ctx.last_checkpoint or {}).get("n", 0))
    for _ in range(2):
        n += 1
        await ctx.emit({"n": n})
    await ctx.checkpoint({"n": n})
    await ctx.emit({"n": n + 1})
    await ctx.emit({"n": n + 2})
    raise RuntimeError("after staging two")


async def floods(ctx: ObserverContext) -> None:
    try:
        while True:
            await ctx.emit({"x": 1})
    except TooManyStaged as exc:
        ERRORS.append(exc)
        raise


async def silent(ctx: ObserverContext) -> None:
    await asyncio.Event().wait()


KINDS.update(
    {
        "emits": KindSpec("emits", emits),
        "emits_then_fails": KindSpec(
            "emits_then_fails",
            emits_then_fails,
            restart_policy=RestartPolicy(max_restarts=1, base_delay=0.05, max_delay=0.05),
        ),
        "floods": KindSpec(
            "floods",
            floods,
            restart_policy=RestartPolicy(max_restarts=0, base_delay=0.05, max_delay=0.05),
        ),
        "silent": KindSpec(
            "silent",
            silent,
            restart_policy=RestartPolicy(
                max_restarts=1, base_delay=0.05, max_delay=0.05, progress_timeout=0.2
            ),
        ),
    }
)


async def test_records_get_seqs_from_the_last_committed_and_reach_the_broker_in_order() -> None:
    async with harness() as h:
        row = h.store.add("emits")
        row.output_seq = 40  # an earlier copy committed 40: this one continues at 41
        row.checkpoint = {"n": 40}
        await h.run(row)
        await until(lambda: len(h.broker.outputs) >= 30)
        seqs = [o.seq for o in h.broker.outputs]
        assert seqs == list(range(41, 41 + len(seqs)))
        assert [o.record["n"] for o in h.broker.outputs] == seqs
        # Confirmed commits leave the outbox.
        await until(lambda: all(k[1] > 60 for k in h.store.outputs))
        assert row.output_seq >= seqs[-1]


async def test_what_a_run_staged_and_never_committed_is_never_delivered() -> None:
    async with harness() as h:
        row = h.store.add("emits_then_fails")
        await h.run(row)
        await until(lambda: row.status.value == "failed")
        await until(lambda: len(h.broker.outputs) == 4)
        # Run 1 committed 1, 2; its 3, 4 were dropped; run 2 emitted 3, 4 again and committed.
        assert [(o.seq, o.record["n"]) for o in h.broker.outputs] == [(i, i) for i in (1, 2, 3, 4)]


async def test_the_records_of_a_refused_commit_are_never_published() -> None:
    async with harness() as h:
        row = h.store.add("emits")
        await h.run(row)
        await until(lambda: len(h.broker.outputs) >= 6)
        # Another service took it over: every later commit of this copy is refused.
        row.epoch, row.service_id = row.epoch + 1, uuid.uuid4()
        committed = row.output_seq
        await until(lambda: row.id not in h.service.runners)
        assert await h.service.outputs.flushed(5.0)  # whatever was handed to the publisher
        assert max(o.seq for o in h.broker.outputs) <= committed


async def test_older_commits_left_by_another_service_go_out_first() -> None:
    async with harness() as h:
        row = h.store.add("emits")
        h.store.left_by_others[(row.id, 1)] = Committed(
            row.id, 1, 1, "emits", "fake", 0.0, ('{"n": 1}', '{"n": 2}')
        )
        row.output_seq, row.checkpoint, row.epoch = 2, {"n": 2}, 1
        await h.run(row)
        await until(lambda: len(h.broker.outputs) >= 10)
        seqs = [o.seq for o in h.broker.outputs]
        assert seqs[:3] == [1, 2, 3]
        assert seqs == sorted(seqs)


async def test_a_broker_outage_repeats_messages_but_never_reorders_or_skips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = {"left": 3}
    real = FakeSession.publish_outputs

    async def flaky(self: FakeSession, commits: Any) -> None:
        if failures["left"] > 0:
            failures["left"] -= 1
            # Half of them were routed before the channel went: the retry repeats them.
            for c in commits[: len(commits) // 2]:
                self.broker.outputs.extend(c.outputs())
            raise BrokerUnavailable("channel closed")
        await real(self, commits)

    monkeypatch.setattr(FakeSession, "publish_outputs", flaky)
    async with harness() as h:
        row = h.store.add("emits")
        await h.run(row)
        await until(lambda: len({o.seq for o in h.broker.outputs}) >= 60, timeout=10)
        first_seen: list[int] = []
        for o in h.broker.outputs:
            if o.seq not in first_seen:
                first_seen.append(o.seq)
        assert first_seen == list(range(1, len(first_seen) + 1))


async def test_a_kind_that_floods_without_a_checkpoint_fails_its_run_not_the_memory() -> None:
    ERRORS.clear()
    async with harness() as h:
        row = h.store.add("floods")
        await h.run(row)
        await until(lambda: row.status.value == "failed", timeout=10)
        assert isinstance(ERRORS[0], TooManyStaged)
        assert "TooManyStaged" in (row.last_error or "")


async def test_emit_waits_while_too_much_is_unconfirmed() -> None:
    writes: list[Checkpoint] = []

    async def write(item: Checkpoint) -> None:
        writes.append(item)

    outputs = CopyOutputs(
        observer_id=uuid.uuid4(),
        epoch=1,
        kind="k",
        name="n",
        last_seq=0,
        write=write,
        commit_every=0.01,
        to_json=lambda r: str(r),
    )
    outputs.unconfirmed = LIMIT - 1
    await outputs.emit(1)
    waiting = asyncio.create_task(outputs.emit(2))
    await asyncio.sleep(0.02)
    assert not waiting.done()  # staged 1 + unconfirmed LIMIT - 1: full
    outputs.confirmed(10)
    await asyncio.wait_for(waiting, 1)
    await outputs.commit(None)
    assert writes[-1].records == ("1", "2")
    assert writes[-1].first_seq == 1


async def test_a_copy_that_commits_nothing_is_restarted_for_no_progress() -> None:
    async with harness() as h:
        row = h.store.add("silent")
        await h.run(row)
        await until(lambda: row.status.value == "failed", timeout=5)
        assert "no progress for 0.2 s" in (row.last_error or "")


def test_the_limit_is_what_the_docs_say() -> None:
    assert outputs_module.LIMIT == 10_000


async def test_a_copy_new_while_another_lookup_is_in_flight_still_gets_its_older_first() -> None:
    """The publisher looks up what other copies left before a copy's first records. A copy whose
    first commit lands while another copy's lookup awaits the database is looked up in the
    next round: its observer's older commits still go out before its own."""
    from observer_service.metrics import ServiceMetrics
    from observer_service.outputs import OutputPublisher
    from tests.support.fakes import InMemoryStore

    store = InMemoryStore(uuid.uuid4())
    a, b = uuid.uuid4(), uuid.uuid4()
    store.left_by_others[(b, 1)] = Committed(b, 1, 1, "k", "b", 0.0, ('{"n": 1}', '{"n": 2}'))
    gate = asyncio.Event()
    real = store.outputs_backlog
    looked_up: list[list[uuid.UUID]] = []

    async def slow_lookup(ids: Any) -> list[Committed]:
        looked_up.append(list(ids))
        await gate.wait()
        return await real(ids)

    store.outputs_backlog = slow_lookup  # type: ignore[method-assign,assignment]
    sent: list[tuple[uuid.UUID, int]] = []

    class Session:
        is_open = True

        async def publish_outputs(self, commits: Any) -> None:
            sent.extend((o.observer_id, o.seq) for c in commits for o in c.outputs())

    publisher = OutputPublisher(store, lambda: Session(), ServiceMetrics())  # type: ignore[arg-type,return-value]
    owners = {}
    for oid, first in ((a, 1), (b, 3)):
        owners[oid] = CopyOutputs(
            observer_id=oid,
            epoch=2,
            kind="k",
            name="n",
            last_seq=first - 1,
            write=lambda _: asyncio.sleep(0),
            commit_every=None,
            to_json=str,
        )
        publisher.register(owners[oid])
    running = asyncio.create_task(publisher.run())
    try:
        publisher.landed(Checkpoint(a, 2, None, ('{"n": 1}',), 1))
        await until(lambda: looked_up == [[a]])
        publisher.landed(Checkpoint(b, 2, None, ('{"n": 3}',), 3))  # during a's lookup
        gate.set()
        await until(lambda: (b, 3) in sent)
        assert [seq for oid, seq in sent if oid == b] == [1, 2, 3]
    finally:
        running.cancel()


def _copy(budget: OutputBudget, commit_every: float | None) -> CopyOutputs:
    async def write(item: Checkpoint) -> None:
        await asyncio.sleep(0)

    return CopyOutputs(
        observer_id=uuid.uuid4(),
        epoch=1,
        kind="k",
        name="n",
        last_seq=0,
        write=write,
        commit_every=commit_every,
        to_json=str,
        budget=budget,
    )


async def test_the_bytes_a_service_holds_are_bounded_across_its_copies() -> None:
    """Two copies share one budget: past it an emit waits until a confirm makes room; a copy
    that commits only with its checkpoints, and holds staged records, is told to checkpoint."""
    budget = OutputBudget(1000)
    a, b = _copy(budget, 0.01), _copy(budget, None)
    await a.emit("a" * 600)
    await b.emit("b" * 300)
    assert budget.held == 900
    waiting = asyncio.create_task(a.emit("a" * 200))
    await asyncio.sleep(0.01)
    assert not waiting.done(), "over the budget: it waits"
    with pytest.raises(TooManyStaged, match="ORCH_OUTPUT_BUFFER_BYTES"):
        await b.emit("b" * 200)
    await a.commit(None)
    a.unconfirmed = 1  # what the publisher counts for the commit
    a.confirmed(1)
    async with asyncio.timeout(1):
        await waiting
    assert budget.held == 500
    b.release_budget()
    a.release_budget()
    assert budget.held == 0
