"""What a copy emits, from ``ctx.emit`` to a confirmed message on ``<prefix>.outputs``.

``CopyOutputs`` (one per copy) stages records and commits them: with the state at
``ctx.checkpoint``, or on its own every ``commit_every`` seconds for a kind that declares it.
A commit is one fenced write (``queries.COMMIT``, batched with other copies' checkpoints): the
records get ``seq`` onwards from the observer's last committed one, or nothing lands.

``OutputPublisher`` (one per service) publishes what this service committed, right after the
commit, and deletes each commit from the outbox once the broker confirmed all of its records.
Per observer it publishes in seq order, and a round's confirms all arrive before the next
round starts. Before a copy's first records it publishes what other copies of that observer
committed and nobody has confirmed yet (a crashed or frozen service's), so a consumer never
sees a seq before those older than it. What a dead service left and nobody publishes (its
observer commits nothing more) the leader relays.

Backpressure: ``emit`` waits while a copy has ``LIMIT`` records staged or unconfirmed. A copy
that commits only with its checkpoints and stages ``LIMIT`` records without one is an error of
its kind (it is restarted from its checkpoint): nothing is dropped, nothing grows unbounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from observer_service.metrics import ServiceMetrics
from observer_service.ports import BrokerSession, Checkpoint, Locked, Store
from orch_contracts import aio
from orch_contracts.backoff import Backoff
from orch_contracts.batching import LINGER, Batcher
from orch_contracts.errors import BrokerUnavailable, Transient
from orch_contracts.outputs import Committed, check_record

log = logging.getLogger(__name__)

#: Records a copy may have staged or unconfirmed before ``emit`` waits.
LIMIT = 10_000
#: Bytes of records a service holds across its copies, staged or unconfirmed, by default.
DEFAULT_BUFFER_BYTES = 256 << 20
#: Records published in one round at most (a backlog goes out in several).
ROUND = 5_000


class TooManyStaged(Exception):
    """A copy that commits with its checkpoints staged ``LIMIT`` records without one (or more
    bytes than the service's ``OutputBudget`` leaves it)."""


class OutputBudget:
    """The bytes of records this service holds, staged or committed and not yet confirmed by
    the broker, across all its copies: an ``emit`` past ``limit`` waits until commits and
    confirms make room (a copy that holds nothing may always emit one record, so each copy
    goes on)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._given = aio.Event()

    def full(self, size: int) -> bool:
        return self.held + size > self.limit

    def take(self, size: int) -> None:
        self.held += size

    def give(self, size: int) -> None:
        self.held = max(0, self.held - size)
        self._given.set()

    async def room(self) -> None:
        """Wait until some bytes are given back (the caller looks again)."""
        self._given.clear()
        await self._given.wait()


class CopyOutputs:
    """One copy's staged records and its commits (one at a time, in order)."""

    def __init__(
        self,
        *,
        observer_id: uuid.UUID,
        epoch: int,
        kind: str,
        name: str,
        last_seq: int,
        write: Callable[[Checkpoint], Awaitable[None]],
        commit_every: float | None,
        to_json: Callable[[Any], str],
        budget: OutputBudget | None = None,
    ) -> None:
        self.observer_id = observer_id
        self.epoch = epoch
        self.kind = kind
        self.name = name
        #: The last seq committed (by this copy or, before its first commit, an earlier one).
        self.last_seq = last_seq
        self.commit_every = commit_every
        #: When this copy last committed (the event loop's clock): its progress.
        self.committed_at = asyncio.get_running_loop().time()
        self._write = write
        self._to_json = to_json
        self._staged: list[str] = []
        #: Records committed and not yet confirmed by the broker.
        self.unconfirmed = 0
        self._budget = budget if budget is not None else OutputBudget(1 << 62)
        #: The sizes of the records committed and not yet confirmed, oldest first.
        self._unconfirmed_sizes: deque[int] = deque()
        #: Bytes this copy holds against the budget (staged and unconfirmed).
        self.held_bytes = 0
        self._lock = asyncio.Lock()
        self._room = aio.Event()
        self._room.set()
        #: Seconds a stop of this copy waited on its commit write, as yet; and since when
        #: (the event loop's clock) one waits now. ``orch verify`` counts that wait as the
        #: orchestrator's, not as the kind's slowness to stop.
        self.stop_waited = 0.0
        self._stop_waits_since: float | None = None
        #: Set while records are staged: a copy that emits nothing costs its commit loop no
        #: wake-ups (a thousand copies polling every 5 ms kept a core busy).
        self._pending = aio.Event()

    @property
    def staged(self) -> int:
        return len(self._staged)

    async def emit(self, record: Any) -> None:
        text = check_record(self._to_json(record))
        while self.held_bytes and self._budget.full(len(text)):
            if self.commit_every is None and self._staged:
                raise TooManyStaged(
                    f"this service holds {self._budget.held} bytes of records, its limit "
                    "(ORCH_OUTPUT_BUFFER_BYTES): checkpoint more often, or declare the kind "
                    "with commit_every"
                )
            await self._budget.room()
        while len(self._staged) + self.unconfirmed >= LIMIT:
            if self.commit_every is None and len(self._staged) >= LIMIT:
                raise TooManyStaged(
                    f"{LIMIT} records emitted since the last checkpoint: checkpoint more often, "
                    "or declare the kind with commit_every"
                )
            self._room.clear()
            await self._room.wait()
        self._staged.append(text)
        self._hold(len(text))
        self._pending.set()

    def _hold(self, size: int) -> None:
        self.held_bytes += size
        self._budget.take(size)

    def _unhold(self, size: int) -> None:
        size = min(size, self.held_bytes)
        self.held_bytes -= size
        self._budget.give(size)

    async def commit(self, state_json: str | None) -> None:
        """Commit ``state_json`` (None: unchanged) with every record staged so far; raises what
        the write raises (Fenced, LeaseLost: nothing landed, and the copy stops).

        A cancellation (a stop while the lease holds) does not cut the write short: it goes on,
        and what it landed counts before the cancellation goes on up, so that a cleanup's own
        checkpoint continues from the right seq. The records are handed to the publisher by
        the checkpoint writer as the write lands (``OutputPublisher.landed``), whatever becomes
        of this coroutine meanwhile."""
        async with self._lock:
            records = tuple(self._staged)
            if state_json is None and not records:
                return
            first = self.last_seq + 1
            item = Checkpoint(self.observer_id, self.epoch, state_json, records, first)
            writing = asyncio.ensure_future(self._write(item))
            writing.add_done_callback(_retrieved)
            try:
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                await self._stop_waits_on(writing)
                if not writing.cancelled() and writing.exception() is None:
                    self._landed(records, first)
                raise
            self._landed(records, first)

    async def _stop_waits_on(self, writing: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        self._stop_waits_since = since = loop.time()
        try:
            await asyncio.wait([writing])
        finally:
            self._stop_waits_since = None
            self.stop_waited += loop.time() - since

    def stop_waiting_now(self) -> float:
        """Seconds a stop of this copy has waited on its commit write, if it waits on one now
        (0.0: it does not)."""
        since = self._stop_waits_since
        if since is None:
            return 0.0
        return self.stop_waited + asyncio.get_running_loop().time() - since

    def _landed(self, records: tuple[str, ...], first: int) -> None:
        del self._staged[: len(records)]
        self._unconfirmed_sizes.extend(len(r) for r in records)
        if not self._staged:
            self._pending.clear()
        self.last_seq = first - 1 + len(records)
        self.committed_at = asyncio.get_running_loop().time()
        self._wake()

    def discard_staged(self) -> None:
        """Forget what is staged: the run that staged it ended without committing it."""
        self._unhold(sum(len(r) for r in self._staged))
        self._staged.clear()
        self._pending.clear()
        self._wake()

    def confirmed(self, count: int) -> None:
        self.unconfirmed = max(0, self.unconfirmed - count)
        sizes = self._unconfirmed_sizes
        self._unhold(sum(sizes.popleft() for _ in range(min(count, len(sizes)))))
        self._wake()

    def release_budget(self) -> None:
        """The copy ended: what it still holds no longer counts against the service's budget
        (its commits are published from the database's copy, by whoever does)."""
        self._unconfirmed_sizes.clear()
        self._unhold(self.held_bytes)

    def _wake(self) -> None:
        if len(self._staged) + self.unconfirmed < LIMIT:
            self._room.set()

    async def commit_on_its_own(self, lease_valid: Callable[[], bool]) -> None:
        """For a kind with ``commit_every``: commit what is staged at most ``commit_every``
        seconds after its first record, and once more when cancelled (the copy stopped while
        its lease holds)."""
        assert self.commit_every is not None
        try:
            while True:
                await self._pending.wait()
                await asyncio.sleep(self.commit_every)
                if self._staged:
                    await self.commit(None)
        except asyncio.CancelledError:
            if self._staged and lease_valid():
                await self.commit(None)
            raise


def _retrieved(task: asyncio.Future[None]) -> None:
    """A write whose copy was abandoned meanwhile: its error is nobody's to raise."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Pending:
    owner: CopyOutputs | None
    commit: Committed


class OutputPublisher:
    """Publishes this service's commits (see the module's docstring)."""

    def __init__(
        self,
        store: Store,
        session: Callable[[], BrokerSession | None],
        metrics: ServiceMetrics,
        budget: OutputBudget | None = None,
    ) -> None:
        self.store = store
        #: The bytes of records the service's copies hold, all together.
        self.budget = budget if budget is not None else OutputBudget(DEFAULT_BUFFER_BYTES)
        self._session = session
        self.metrics = metrics
        metrics.outputs_unconfirmed.set_function(lambda: self.unconfirmed)
        metrics.oldest_unconfirmed.set_function(
            lambda: 0.0 if (t := self.oldest()) is None else max(0.0, time.time() - t)
        )
        self._pending: dict[uuid.UUID, deque[_Pending]] = {}
        #: Copies (observer, epoch) whose older commits were looked for.
        self._looked: set[tuple[uuid.UUID, int]] = set()
        #: Copies with commits pending here whose older commits are yet to be looked for.
        self._unlooked: set[tuple[uuid.UUID, int]] = set()
        #: The copies committing here, by (observer, epoch).
        self._owners: dict[tuple[uuid.UUID, int], CopyOutputs] = {}
        self._wake = asyncio.Event()
        #: Set while nothing is pending.
        self._empty = asyncio.Event()
        self._empty.set()
        #: The commits (checkpoints, records) of every copy here, written in batches: one
        #: statement each (``Store.checkpoint_many``); the service runs its writer.
        self.commits: Batcher[Checkpoint, bool | Locked] = Batcher(
            self._commit_batch, linger=LINGER
        )

    async def _commit_batch(self, items: list[Checkpoint]) -> list[bool | Locked]:
        started = time.perf_counter()
        done = await self.store.checkpoint_many(items)
        for item, answer in zip(items, done, strict=True):
            if answer is True and item.records:
                self.landed(item)  # published whatever becomes of the copy meanwhile
        self.metrics.checkpoint_flush.observe(time.perf_counter() - started)
        self.metrics.checkpoint_batch.observe(len(items))
        return done

    async def flushed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until everything pending was confirmed."""
        try:
            async with asyncio.timeout(timeout):
                await self._empty.wait()
            return True
        except TimeoutError:
            log.warning("%d committed records not published at shutdown", self.unconfirmed)
            return False

    @property
    def unconfirmed(self) -> int:
        return sum(len(p.commit.records) for q in self._pending.values() for p in q)

    def oldest(self) -> float | None:
        """When the oldest commit not yet confirmed was made (epoch seconds), or None."""
        times = [q[0].commit.committed_at for q in self._pending.values() if q]
        return min(times, default=None)

    def register(self, owner: CopyOutputs) -> None:
        """A copy that commits here: what lands of it is published from memory."""
        self._owners[(owner.observer_id, owner.epoch)] = owner

    def unregister(self, owner: CopyOutputs) -> None:
        owner.release_budget()
        self._owners.pop((owner.observer_id, owner.epoch), None)
        self._looked.discard((owner.observer_id, owner.epoch))

    def landed(self, item: Checkpoint) -> None:
        """A commit landed (as its batch's statement answers): its
        records go out. One of a copy no longer here stays in the outbox for the next holder's
        lookup of older commits, or the leader's relay."""
        owner = self._owners.get((item.observer_id, item.epoch))
        if owner is None or not item.records:
            return
        owner.unconfirmed += len(item.records)
        commit = Committed(
            item.observer_id,
            item.first_seq,
            item.epoch,
            owner.kind,
            owner.name,
            time.time(),
            item.records,
        )
        self.submit(owner, commit)

    def submit(self, owner: CopyOutputs | None, commit: Committed) -> None:
        self.metrics.outputs_committed.labels(commit.kind).inc(len(commit.records))
        self._pending.setdefault(commit.observer_id, deque()).append(_Pending(owner, commit))
        if owner is not None and (copy := (commit.observer_id, commit.epoch)) not in self._looked:
            self._unlooked.add(copy)
        self._empty.clear()
        self._wake.set()

    async def run(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._round()
                backoff.reset()
            except Transient as exc:
                log.warning("outputs not published yet (retrying): %s", exc)
                await asyncio.sleep(backoff.next())
                self._wake.set()

    async def _round(self) -> None:
        """Publish everything pending, in seq order per observer; on a failure everything stays
        pending (a retry may repeat a message, never reorder or skip one)."""
        if not self._pending:
            return
        await self._older_first()
        session = self._session()
        if session is None or not session.is_open:
            raise BrokerUnavailable("no broker session")
        taken: dict[uuid.UUID, list[_Pending]] = {}
        size = 0
        # An observer with a copy not yet looked up (its first commit landed while a lookup
        # awaited) waits for the next round, which looks it up first.
        waiting = {oid for oid, _ in self._unlooked}
        for oid, queue in self._pending.items():
            if oid in waiting:
                continue
            for p in queue:  # a prefix of each observer's queue: its order holds
                if size >= ROUND:
                    break
                taken.setdefault(oid, []).append(p)
                size += len(p.commit.records)
        if size >= ROUND or waiting:
            self._wake.set()  # the rest in the next round
        commits = [p.commit for ps in taken.values() for p in ps]
        started = time.time()
        await session.publish_outputs(commits)
        now = time.time()
        for oid, ps in taken.items():
            queue = self._pending[oid]
            for p in ps:
                queue.popleft()
                self.metrics.outputs_published.inc(len(p.commit.records))
                self.metrics.output_lag.observe(max(0.0, now - p.commit.committed_at))
                if p.owner is not None:
                    p.owner.confirmed(len(p.commit.records))
            if not queue:
                del self._pending[oid]
        if not self._pending:
            self._empty.set()
        self.metrics.output_publish.observe(now - started)
        try:
            await self.store.delete_published([c.key for c in commits])
        except Transient as exc:  # published: a repeat later (the relay's) is allowed
            log.warning("published outputs stay in the outbox for now: %s", exc)

    async def _older_first(self) -> None:
        """Before a copy's first records: what earlier copies of that observer committed and
        nobody confirmed (on a service that died or froze, or here, a copy whose last commit
        landed after it was gone), older than them, goes first."""
        # Taken out before the lookup awaits: a copy whose first commit lands meanwhile is
        # looked up in the next round, not marked looked unasked.
        new, self._unlooked = self._unlooked, set()
        if not new:
            return
        try:
            found = await self.store.outputs_backlog(sorted({oid for oid, _ in new}, key=str))
        except BaseException:
            self._unlooked |= new
            raise
        self._looked |= new
        # Per observer, the first seq of the copies looked up now: what is older goes first.
        first: dict[uuid.UUID, int] = {}
        for oid in {oid for oid, _ in new}:
            for p in self._pending.get(oid, ()):
                if (oid, p.commit.epoch) in new:
                    first[oid] = min(first.get(oid, p.commit.seq), p.commit.seq)
        for c in found:
            pending = self._pending.get(c.observer_id)
            if pending is None or c.seq >= first.get(c.observer_id, 0):
                continue
            if all(p.commit.key != c.key for p in pending):
                pending.append(_Pending(None, c))
        for oid in {c.observer_id for c in found} & self._pending.keys():
            self._pending[oid] = deque(sorted(self._pending[oid], key=lambda p: p.commit.seq))


#: ``\u0000`` as an escape, not as the text after an escaped backslash.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def checkpoint_json(state: Any) -> str:
    """``state`` as the JSON a checkpoint stores, or ValueError for what PostgreSQL's jsonb would
    refuse (NaN and the infinities, the NUL character). Refused here, in the kind's own call: in
    the batched write it would fail the checkpoints of every observer in the same batch."""
    try:
        text = json.dumps(state, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"a checkpoint cannot hold NaN or infinity: {exc}") from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise ValueError("a checkpoint cannot hold the NUL character (\\u0000)")
    return text
