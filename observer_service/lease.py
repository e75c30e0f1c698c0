"""The service's lease: one row renewed for all its observers, held through one database session
whose advisory lock shows others that this process lives.

Takers treat a holder as gone only when its lock is free *and* its broker connection is gone
(its exclusive control queue no longer exists). So when the lease session ends while the process
lives (a pooler, ``pg_terminate_backend``, a database restart), nothing can take our observers
as long as our broker connection stays open. The keeper then reconnects on a new session with a
new lock key and goes on only after a round trip on the *same* broker connection proves that
connection never closed meanwhile; if it cannot prove it, or the broker connection closes while
the lease session is down, it fences.

States (``state()``, which kind code and admission consult before every step):

- FRESH: renewed recently; work goes on.
- STALE: valid, but not confirmed for ``renew_interval + margin`` (this process may have been
  paused, its session may have ended meanwhile): work waits for the next renewal.
- LOST: fenced. The local deadline passed, a renewal found the lease expired in the database, or
  both links were lost at once. Every copy is stopped at once (``on_lost``); the lease comes
  back only after the service has stopped everything and let go of it (``allow_rejoin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable

from contracts.clock import Clock
from contracts.deadline import LeaseDeadline, LeaseTimings
from contracts.errors import BrokerUnavailable, DatabaseUnavailable, LeaseLost
from observer_service.ports import LeaseDatabase, LeaseSession, Renewal, Witness

log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    FRESH = "fresh"
    STALE = "stale"
    LOST = "lost"


class LeaseKeeper:
    def __init__(
        self,
        database: LeaseDatabase,
        *,
        timings: LeaseTimings,
        clock: Clock,
    ) -> None:
        self.database = database
        self.timings = timings
        self.clock = clock
        self.deadline = LeaseDeadline(clock, timings)
        #: Called (synchronously) the moment the lease is lost; the service sets it.
        self.on_lost: Callable[[str], None] = lambda _reason: None
        #: Told how long each renewal took; the service sets it.
        self.observe_renewal: Callable[[float], None] = lambda _seconds: None
        #: The broker session to prove continuity with; the service sets it.
        self.witness: Callable[[], Witness | None] = lambda: None
        self._session: LeaseSession | None = None
        self._fenced = True  # nothing runs before the first renewal
        #: Set while the lease session is down: the broker session that must stay open.
        self._bridging: Witness | None = None
        self._rejoin = asyncio.Event()
        self._wake = asyncio.Event()
        self._waiters: set[asyncio.Future[None]] = set()
        #: What each renewal learned, consumed by the service's own task.
        self.renewals: asyncio.Queue[Renewal] = asyncio.Queue()

    # ------------------------------------------------------------------ what others consult
    def state(self) -> LeaseState:
        if self._fenced:
            return LeaseState.LOST
        if not self.deadline.valid():
            self.fence("lease deadline passed")
            return LeaseState.LOST
        return LeaseState.STALE if self.deadline.stale() else LeaseState.FRESH

    def check_or_fence(self) -> bool:
        """True while the lease is surely ours; fences everything the moment it is not."""
        return self.state() is not LeaseState.LOST

    def gate(self) -> asyncio.Future[None] | None:
        """For ``guarded``: go on (None), wait for the next renewal (a future), or LeaseLost."""
        state = self.state()
        if state is LeaseState.LOST:
            raise LeaseLost("service lease is no longer valid")
        if state is LeaseState.FRESH:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        fut.add_done_callback(self._waiters.discard)
        self._wake.set()  # renew now rather than on schedule
        return fut

    @property
    def fenced(self) -> bool:
        return self._fenced

    # ------------------------------------------------------------------ transitions
    def fence(self, reason: str) -> None:
        """Stop everything now: others may take our observers from this moment on."""
        if self._fenced:
            return
        self._fenced = True
        self._bridging = None
        self.deadline.expire()
        log.warning("lease lost (%s): stopping every observer of this service", reason)
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_exception(LeaseLost(reason))
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("stopping the observers after a lost lease failed")

    def session_ended(self) -> None:
        """The lease session ended by itself: reconnect, keeping the observers only if the
        broker connection proves it stayed open (see the module's docstring)."""
        if self._fenced or self._bridging is not None:
            return
        witness = self.witness()
        if witness is None:
            self.fence("lease session ended while off the broker")
            return
        log.warning(
            "lease session ended; reconnecting (broker session %d must hold)", witness.generation
        )
        self._bridging = witness
        self._wake.set()

    def broker_lost(self, generation: int) -> None:
        """The service's broker session closed."""
        if self._bridging is not None and self._bridging.generation == generation:
            self.fence("lease session and broker connection both lost")

    def allow_rejoin(self) -> None:
        """The service runs nothing and holds nothing: the lease may come back."""
        self._rejoin.set()

    def _confirmed(self, sent: float) -> None:
        self.deadline.renewed(sent)
        self._fenced = False
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

    async def start(self) -> None:
        """Register the service with a first lease (raises DatabaseUnavailable)."""
        await self._join()

    async def _join(self) -> None:
        """Register or come back after a fence, on a new session (new lock key)."""
        session = await self._connect()
        sent = self.clock.now()
        await session.join(self.timings.ttl)
        self._bridging = None
        self._confirmed(sent)
        self._rejoin.clear()

    async def _bridge(self) -> None:
        """A new session after ours ended, kept only if the broker connection held."""
        witness = self._bridging
        assert witness is not None
        await self._connect()
        try:
            held = await witness.confirm_present()
        except BrokerUnavailable:
            held = False
        if not held:
            self.fence("lease session ended and the broker connection did not hold")
            return
        if self._bridging is witness:
            self._bridging = None

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Renew for ever; fence when the lease is no longer surely ours; rejoin when allowed."""
        backoff = 0.0
        while True:
            if self._fenced:
                await self._rejoin.wait()
                try:
                    await self._join()
                    log.info("lease back on a new session")
                    backoff = 0.0
                except DatabaseUnavailable as exc:
                    backoff = _next(backoff)
                    log.warning("cannot rejoin yet (%s); retrying in %.2fs", exc, backoff)
                    await asyncio.sleep(backoff)
                continue
            if backoff:
                await asyncio.sleep(backoff)
            elif self._bridging is None:
                due = self.timings.renew_interval - (self.clock.now() - self.deadline.confirmed)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), max(0.0, min(due, self.deadline.remaining()))
                    )
            backoff = await self._renew_once(backoff)

    async def _renew_once(self, backoff: float) -> float:
        """One renewal; returns the wait before the next attempt (0: on schedule)."""
        if not self.check_or_fence():
            return 0.0
        sent = self.clock.now()
        try:
            if self._bridging is not None:
                await self._bridge()
                if self._fenced:
                    return 0.0
            session = self._session
            assert session is not None
            renewal = await session.renew(
                self.timings.ttl, timeout=max(0.05, self.deadline.remaining())
            )
            self.observe_renewal(self.clock.now() - sent)
        except DatabaseUnavailable as exc:
            if self._session is not None and self._session.ended:
                self.session_ended()
            backoff = _next(backoff)
            log.warning("lease renewal failed (%s); retrying in %.2fs", exc, backoff)
            return backoff
        if renewal is None:
            self.fence("the lease had expired in the database")
            return 0.0
        if not self.check_or_fence():  # the deadline passed while we waited: do not extend
            return 0.0
        self._confirmed(sent)
        self.renewals.put_nowait(renewal)
        return 0.0

    async def close(self, *, deleted: bool) -> None:
        """Leave: mark the service deleted (graceful stop) and end the session."""
        session, self._session = self._session, None
        self._fenced = True
        if session is not None:
            await session.close(deleted=deleted)


def _next(backoff: float) -> float:
    """Retry soon, then less often: 20 ms doubling up to 250 ms."""
    return min(0.25, max(0.02, backoff * 2))
