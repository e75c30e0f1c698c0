"""The service's lease: one row renewed for all its observers, held through one database session
whose advisory lock shows others that this process lives.

Takers treat a live holder as gone only when its lock is free *and* its broker connection is
gone (its exclusive control queue no longer exists), and their compare-and-set holds only while
the holder's row still names the lock key they found free. So when the lease session ends while
the process lives (a pooler, ``pg_terminate_backend``, a database restart), possibly while it is
also cut off from the broker: every copy pauses at its next resumption; the keeper connects a new
session (a new lock key), renews on it, which publishes the new key (from that commit on, no
fast take can land), and then reads which rows are still ours. Copies whose rows another service
took meanwhile are stopped without resuming (``Listener.superseded``); the others go on.

States (``state()``, which kind code and admission consult before every step; reading it is
pure: the fence itself happens on the keeper's own schedule, a timer at the deadline):

- FRESH: renewed recently; work goes on.
- STALE: valid, but not confirmed for ``renew_interval + margin`` (this process may have been
  paused, its session may have ended meanwhile), or the lease session ended and the new one has
  not yet shown what is still ours: work waits for the next renewal.
- LOST: fenced. The local deadline passed, or a renewal found the lease expired in the database.
  Every copy is stopped at once (``Listener.lease_lost``); the lease comes back only after the
  service has stopped everything and released it (``allow_rejoin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Collection
from typing import Protocol

from observer_service.ports import Copy, LeaseDatabase, LeaseSession, Renewal
from orch_contracts.backoff import Backoff
from orch_contracts.clock import Clock
from orch_contracts.deadline import LeaseDeadline, LeaseTimings
from orch_contracts.errors import DatabaseUnavailable, LeaseLost, timed_out

log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    FRESH = "fresh"
    STALE = "stale"
    LOST = "lost"


class Listener(Protocol):
    """What the keeper tells the service, and asks of it (all synchronous)."""

    def lease_lost(self, reason: str) -> None:
        """The lease is lost: stop every copy now."""

    def renewal_took(self, seconds: float) -> None: ...

    def copies(self) -> Collection[Copy]:
        """The copies running here."""
        ...

    def stalled_lately(self) -> bool:
        """Kind code blocked the event loop lately (the renewal keeps the service marked)."""
        ...

    def taking(self) -> Collection[uuid.UUID]:
        """The observers being taken here (the renewal reports them)."""
        ...

    def superseded(self, copies: Collection[Copy], held: Collection[Copy] = ()) -> None:
        """These copies' rows no longer name them (``held``: the rows that name us): taken by
        another service while the lease session was down, or gone back to an earlier epoch
        of ours (a failover). Stop them before they resume."""


class LeaseKeeper:
    def __init__(
        self,
        database: LeaseDatabase,
        *,
        timings: LeaseTimings,
        clock: Clock,
        listener: Listener,
    ) -> None:
        self.database = database
        self.timings = timings
        self.clock = clock
        self.listener = listener
        self.deadline = LeaseDeadline(clock, timings)
        self._session: LeaseSession | None = None
        self._fenced = True  # nothing runs before the first renewal
        #: The lease session ended: copies wait until a new session shows what is still ours.
        self._bridging = False
        #: How many lease sessions ended by themselves: a take in flight across one is not
        #: judged by the new session's look at our rows, so it must not run.
        self.sessions_ended = 0
        #: Retry soon, then less often: 20 ms doubling up to 250 ms.
        self._backoff = Backoff(0.02, 0.25)
        self._rejoin = asyncio.Event()
        self._wake = asyncio.Event()
        self._waiters: set[asyncio.Future[None]] = set()
        #: Fences at the local deadline unless a renewal moved it.
        self._timer: asyncio.TimerHandle | None = None
        #: What each renewal learned, consumed by the service's own task.
        self.renewals: asyncio.Queue[Renewal] = asyncio.Queue()
        #: The last renewal that told the database's time: when we sent it, and that time.
        self._last_told: tuple[float, float] | None = None

    # ------------------------------------------------------------------ what others consult
    def state(self) -> LeaseState:
        """Pure: a passed deadline reads LOST at once, and the fence follows on its timer."""
        if self._fenced or not self.deadline.valid():
            return LeaseState.LOST
        return LeaseState.STALE if self._bridging or self.deadline.stale() else LeaseState.FRESH

    def valid(self) -> bool:
        """True while the lease is surely ours."""
        return self.state() is not LeaseState.LOST

    def _fence_if_due(self) -> bool:
        """The keeper's own check: fence when the deadline passed; True while valid."""
        if not self._fenced and not self.deadline.valid():
            self.fence("lease deadline passed")
        return not self._fenced

    def _arm(self) -> None:
        """Fence at the deadline, whatever else is happening (a renewal stuck in flight). The
        timer runs on the loop's monotonic clock; after a suspend it may fire late, but
        ``state()`` reads the suspend-aware clock, so nothing resumes meanwhile."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, self.deadline.remaining()), self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self._fence_if_due():
            self._arm()  # renewed meanwhile: the new deadline

    def gate(self) -> asyncio.Future[None] | None:
        """For ``guarded``: go on (None), wait for the next renewal (a future), or LeaseLost."""
        state = self.state()
        if state is LeaseState.LOST:
            if not self._fenced:  # its timer is late (a pause): fence on the loop's next turn
                asyncio.get_running_loop().call_soon(self._fence_if_due)
            raise LeaseLost("service lease is no longer valid")
        if state is LeaseState.FRESH:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        fut.add_done_callback(self._waiters.discard)
        self._wake.set()  # renew now rather than on schedule
        return fut

    @property
    def bridging(self) -> bool:
        return self._bridging

    @property
    def fenced(self) -> bool:
        return self._fenced

    # ------------------------------------------------------------------ transitions
    def fence(self, reason: str) -> None:
        """Stop everything now: others may take our observers from this moment on."""
        if self._fenced:
            return
        self._fenced = True
        self._bridging = False
        self._last_told = None
        self.deadline.expire()
        log.warning("lease lost (%s): stopping every observer of this service", reason)
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_exception(LeaseLost(reason))
        try:
            self.listener.lease_lost(reason)
        except Exception:
            log.exception("stopping the observers after a lost lease failed")

    def session_ended(self) -> None:
        """The lease session ended by itself: pause, and reconnect (see the module's
        docstring)."""
        if self._fenced or self._bridging:
            return
        log.warning("lease session ended: observers pause until a new session shows they are ours")
        self.sessions_ended += 1
        self._bridging = True
        self._wake.set()

    def allow_rejoin(self) -> None:
        """The service runs nothing and holds nothing: the lease may come back."""
        self._rejoin.set()

    def _confirmed(self, sent: float) -> None:
        self.deadline.renewed(sent)
        self._fenced = False
        self._arm()
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ sessions
    async def _connect(self) -> LeaseSession:
        session = await self.database.connect(self.session_ended)
        old, self._session = self._session, session
        if old is not None:
            old.terminate()
        return session

    async def start(self, until: float = 0.0) -> None:
        """Register the service with a first lease. A database that does not answer in time (a
        slow link) is tried again for as long as it takes, one that refuses until ``until``
        (``time.monotonic()``), with a line in the log each time: an exit would only make a
        supervisor start the process again. Until it has joined, the service takes no work.
        Raises DatabaseUnavailable once a refusal outlasts ``until``."""
        backoff = Backoff(0.5, 10.0, jitter=0.2)
        while True:
            try:
                await self._join()
                return
            except DatabaseUnavailable as exc:
                if not timed_out(exc) and time.monotonic() >= until:
                    raise
                delay = backoff.next()
                log.warning("cannot join yet (%s); trying again in %.1f s", exc, delay)
                await asyncio.sleep(delay)

    async def _renew(self, session: LeaseSession) -> Renewal | None:
        return await session.renew(
            self.timings.ttl,
            timeout=max(0.05, self.deadline.remaining()),
            stalled=self.listener.stalled_lately(),
            taking=self.listener.taking(),
        )

    async def _join(self) -> None:
        """Register or come back after a fence, on a new session (new lock key)."""
        session = await self._connect()
        await session.prepare_join()
        sent = self.clock.now()
        await session.join(self.timings.ttl)
        self._bridging = False
        self._confirmed(sent)
        self._rejoin.clear()

    async def _bridge(self) -> Renewal | None:
        """A new session after ours ended: publish its lock key with a renewal, then stop the
        copies whose rows were taken meanwhile. None when the lease had expired (fenced)."""
        session = await self._connect()
        before = set(self.listener.copies())  # each one's take committed before this renewal
        renewal = await self._renew(session)
        if renewal is None:
            self.fence("the lease had expired in the database")
            return None
        held = await session.held(timeout=max(0.05, self.deadline.remaining()))
        if session.ended:  # its end went unheard while we were bridging: bridge again
            raise DatabaseUnavailable("the new lease session ended too")
        if taken := before - held:
            log.warning(
                "%d observers were taken by others while the lease session was down", len(taken)
            )
            self.listener.superseded(taken, held)
        if self._fence_if_due():
            self._bridging = False
            log.info("lease back on a new session: %d observers go on", len(before & held))
        return renewal

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Renew for ever; fence when the lease is no longer surely ours; rejoin when allowed."""
        wait = 0.0
        while True:
            if self._fenced:
                await self._rejoin.wait()
                try:
                    await self._join()
                    log.info("lease back on a new session")
                    self._backoff.reset()
                except DatabaseUnavailable as exc:
                    wait = self._backoff.next()
                    log.warning("cannot rejoin yet (%s); retrying in %.2fs", exc, wait)
                    await asyncio.sleep(wait)
                continue
            if wait:
                await asyncio.sleep(wait)
            elif not self._bridging:
                due = self.timings.renew_interval - (self.clock.now() - self.deadline.confirmed)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), max(0.0, min(due, self.deadline.remaining()))
                    )
            wait = await self._renew_once()

    async def _renew_once(self) -> float:
        """One renewal; returns the wait before the next attempt (0: on schedule)."""
        if not self._fence_if_due():
            return 0.0
        sent = self.clock.now()
        try:
            renewal: Renewal | None
            if self._bridging:
                renewal = await self._bridge()
                if renewal is None:
                    return 0.0
            else:
                session = self._session
                assert session is not None
                renewal = await self._renew(session)
            self.listener.renewal_took(self.clock.now() - sent)
        except DatabaseUnavailable as exc:
            if self._session is not None and self._session.ended:
                self.session_ended()
            wait = self._backoff.next()
            log.warning("lease renewal failed (%s); retrying in %.2fs", exc, wait)
            return wait
        if renewal is None:
            self.fence("the lease had expired in the database")
            return 0.0
        if not self._fence_if_due():  # the deadline passed while we waited: do not extend
            return 0.0
        if self._unseen_pause(sent, renewal.database_time):
            return 0.0
        self._backoff.reset()
        self._confirmed(sent)
        self.renewals.put_nowait(renewal)
        return 0.0

    def _unseen_pause(self, sent: float, database_time: float | None) -> bool:
        """Whether the database's clock saw more time pass between two renewals than ours
        could have (from the earlier one's send to this one's answer), by more than the
        margin: a pause that stopped every local clock (a stun, a live migration), in which
        our deadline went on looking valid. Then the lease is given up at once (it may have
        been about to end for all we know); the residual is kind code run between the resume
        and this answer, at most one renewal period and its round trip."""
        if database_time is None:
            return False
        last, self._last_told = self._last_told, (sent, database_time)
        if last is None:
            return False
        ours = self.clock.now() - last[0]
        theirs = database_time - last[1]
        if theirs - ours <= self.timings.margin:
            return False
        self.fence(
            f"the database's clock saw {theirs:.1f}s pass where ours saw {ours:.1f}s: "
            "a pause our clocks could not see"
        )
        return True

    async def close(self, *, deleted: bool) -> None:
        """Leave: mark the service deleted (graceful stop) and end the session."""
        session, self._session = self._session, None
        self._fenced = True
        if self._timer is not None:
            self._timer.cancel()
        if session is not None:
            await session.close(deleted=deleted)
