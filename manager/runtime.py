"""Everything a manager process runs besides its routes: the connections, the outbox, and the
leader's loops. The app's lifespan starts and stops it; a task that dies sets ``fatal``, and the
process that owns the runtime decides what to do (``orch manager`` exits non-zero)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from contracts.clock import Clock
from contracts.errors import NameTaken, Transient
from contracts.kinds import KindSpec, get_kind, load_kinds
from manager import background
from manager import repository as repo
from manager.intake import GroupCommit
from manager.leader import Leadership, Loop
from manager.metrics import ManagerMetrics
from manager.outbox import Outbox, Pending
from manager.publisher import Publisher
from manager.rebalance import Rebalancer
from manager.settings import ManagerSettings
from manager.store import ManagerStore

log = logging.getLogger(__name__)

#: Seconds between two reads of the kinds' adverts; and how fresh a read must be for a create
#: of a kind not found in it to be refused without reading again.
ADVERTS_EVERY = 5.0
ADVERTS_FRESH = 1.0


class ManagerRuntime:
    def __init__(
        self,
        settings: ManagerSettings,
        kinds: dict[str, KindSpec] | None = None,
        *,
        replica: str | None = None,
        metrics: ManagerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or ManagerMetrics(refresh=settings.metrics_refresh)
        self.kinds = kinds if kinds is not None else load_kinds(settings.kind_module_list)
        #: Kinds this manager has no code for, as services advertise them (``read_adverts``):
        #: creates of them are checked against the advertised schema, their secrets masked.
        self.advertised: dict[str, KindSpec] = {}
        self._adverts_read = -math.inf
        self.store = ManagerStore(settings)
        self.publisher = Publisher(settings, died=self._died)
        self.outbox = Outbox(self.store, self.publisher)
        #: Single creates of this process, written and published together (``manager.intake``).
        self.creates = GroupCommit(self._create_rows, self.outbox.publish_now)
        self.leadership = Leadership(
            self.store,
            loops=self._leader_loops(),
            timings=settings.lease_timings,
            clock=Clock(settings.clock_hook),
            holder=replica,
        )
        #: Set when a supervised task died; ``error`` says why.
        self.fatal = asyncio.Event()
        self.error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def kind_spec(self, name: str) -> KindSpec | None:
        """The kind, from this manager's code or else from the services' adverts."""
        return self.kinds.get(name) or self.advertised.get(name)

    def all_kinds(self) -> dict[str, KindSpec]:
        return {**self.advertised, **self.kinds}

    async def kind(self, name: str) -> KindSpec:
        """The kind a create names; the adverts are read again (at most once a second) for a
        kind not known yet. Raises UnknownKind, naming the kinds there are."""
        spec = self.kind_spec(name)
        if spec is None and time.monotonic() - self._adverts_read > ADVERTS_FRESH:
            await self.read_adverts()
            spec = self.kind_spec(name)
        if spec is None:
            return get_kind(self.all_kinds(), name)
        return spec

    async def read_adverts(self) -> None:
        """What the services advertised of the kinds this manager has no code for: of each
        kind, the advert of the newest service that runs it (a live one first)."""
        async with self.store.autocommit() as tx:
            adverts = await repo.adverts(tx)
        advertised: dict[str, KindSpec] = {}
        for name, advert in adverts.items():
            if name in self.kinds:
                continue
            try:
                advertised[name] = KindSpec.from_advert(name, advert)
            except (ValueError, TypeError, AttributeError) as exc:  # a later or broken advert
                log.warning("kind %r: its advert cannot be read here, left out: %s", name, exc)
        self.advertised = advertised
        self._adverts_read = time.monotonic()

    async def _create_rows(
        self, new: Sequence[repo.NewObserver]
    ) -> tuple[list[dict[str, Any] | NameTaken], list[Pending]]:
        async with self.store.autocommit() as tx:  # one statement: rows, history, outbox
            return await repo.create_observers(tx, new)

    def _leader_loops(self) -> dict[str, Loop]:
        s = self.settings
        # Directed starts go only to services whose lease outlives a renewal period.
        margin = s.lease_ttl / 2
        sweeper = background.Sweeper(
            self.store, self.outbox, self.publisher, margin, metrics=self.metrics
        )
        audit = background.Audit(
            self.store,
            self.outbox,
            self.publisher,
            grace=s.audit_grace,
            margin=margin,
            metrics=self.metrics,
            patience=max(s.lease_ttl, s.audit_grace),
        )
        loops: dict[str, Loop] = {
            "outbox-relay": background.every(
                s.relay_interval, lambda: self.outbox.relay_once(grace=s.relay_grace), "relay"
            ),
            "sweeper": background.every(s.sweep_interval, sweeper.once, "sweeper"),
            "output-relay": background.every(
                s.relay_interval,
                background.OutputRelay(self.store, self.publisher, self.metrics).once,
                "output relay",
            ),
            "audit": background.every(s.audit_interval, audit.once, "audit"),
        }
        pruner = background.Pruner(
            self.store,
            keep=s.retention,
            keep_services=s.service_retention,
            max_events=s.max_events_per_observer,
        )
        loops["retention"] = background.every(s.prune_interval, pruner.once, "retention")
        if s.rebalance:
            rebalancer = Rebalancer(
                self.store,
                self.outbox,
                self.publisher,
                pace=s.rebalance_pace,
                min_age=s.rebalance_min_age,
                cooldown=s.rebalance_cooldown,
                # Longer than the leader's own recovery of a lost start (a lease, then a sweep
                # or an audit): a move not landed by then will not land as asked.
                landing=2 * s.lease_ttl,
                metrics=self.metrics,
            )
            loops["rebalance"] = background.every(
                s.rebalance_interval, rebalancer.once, "rebalance"
            )
        return loops

    async def start(self) -> None:
        await self.store.open()
        await self.publisher.start()
        self._spawn(self.creates.run(), "group-commit")
        self._spawn(
            background.every(ADVERTS_EVERY, self.read_adverts, "kinds' adverts")(), "adverts"
        )
        self._spawn(
            background.every(0.1, self.outbox.delete_published, "outbox cleanup")(),
            "outbox-cleanup",
        )
        if self.settings.background:
            self._spawn(self.leadership.run(), "leadership")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._died)
        self._tasks.append(task)

    def _died(self, task: asyncio.Task[None]) -> None:
        # stop() removes this callback before it cancels: any end seen here is a death, a
        # cancellation from inside included (a driver's CancelledError).
        self.error = asyncio.CancelledError() if task.cancelled() else task.exception()
        # With its traceback (and its cause's): a bare repr told too little once.
        log.critical(
            "%s died (%r): the manager must stop", task.get_name(), self.error, exc_info=self.error
        )
        self.fatal.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.remove_done_callback(self._died)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.settings.background:
            await self.leadership.release()
        with contextlib.suppress(Transient):
            await self.outbox.delete_published()
        with contextlib.suppress(Transient):
            await self.publisher.close()
        await self.store.close()
