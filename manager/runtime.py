"""Everything a manager process runs besides its routes: the connections, the outbox, and the
leader's loops. The app's lifespan starts and stops it; a task that dies sets ``fatal``, and the
process that owns the runtime decides what to do (``orch manager`` exits non-zero)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import math
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from orch_contracts.adverts import read_advert
from orch_contracts.clock import Clock
from orch_contracts.errors import AdvertRefused, NameTaken, Transient, UnknownKind
from orch_contracts.kinds import KindSpec, get_kind, load_kinds
from orch_contracts.logs import safe_text
from orch_contracts.pools import DEFAULT_POOL
from orch_manager import background, database_facts, journal
from orch_manager import repository as repo
from orch_manager.database_facts import DatabaseFacts
from orch_manager.intake import GroupCommit
from orch_manager.journal import Journal
from orch_manager.leader import LEADER_NAME, Leadership, Loop, new_holder_id
from orch_manager.metrics import ManagerMetrics
from orch_manager.moves import Mover
from orch_manager.outbox import Outbox, Pending
from orch_manager.publisher import Publisher
from orch_manager.rebalance import Rebalancer
from orch_manager.settings import ManagerSettings
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)
#: Seconds each step of a shutdown may take: the tasks' end, then the leadership's release
#: and the outbox's cleanup.
STOP_TIMEOUT = 5.0

#: Seconds between two reads of the kinds' adverts (a create that names a kind, pool or version
#: not found reads them again at once: a service that joined a moment ago counts).
ADVERTS_EVERY = 5.0
#: How often the leader folds the observer counts' rows into one per key, seconds: between two
#: folds, a count reads the rows its changes added (two a move).
FOLD_EVERY = 2.0
#: A fold that dropped this many rows or more vacuums the counts' table after it.
VACUUM_AFTER = 1000


@functools.lru_cache(maxsize=128)  # its keys are texts of up to 256 KiB
def advertised_spec(kind: str, text: str) -> KindSpec:
    """A kind from the JSON text of its advert, read once per text (the adverts are read again
    every few seconds, mostly unchanged). Raises AdvertRefused (never cached)."""
    return KindSpec.from_advert(kind, read_advert(text))


@dataclass
class Offer:
    """The kinds one pool's services advertised, each with its versions; ``every``: one of
    them is of a release before adverts, and runs every kind (in no version that a create may
    pin)."""

    every: bool = False
    kinds: dict[str, set[str]] = field(default_factory=dict)


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
        #: Each advertised version of each kind, known from the adverts alone.
        self.versions: dict[tuple[str, str], KindSpec] = {}
        #: Every distinct advert of each version of each kind (what masks an observer's params).
        self._all_versions: dict[tuple[str, str], list[KindSpec]] = {}
        #: The kinds each service runs, with their versions (None: a release before adverts).
        self.holders: dict[uuid.UUID, dict[str, str] | None] = {}
        self._logged_refusals: set[tuple[str, str, str]] = set()
        #: What each pool's services advertised: a create names one of its pool's kinds.
        self.offered: dict[str, Offer] = {}
        #: When the last read of the adverts began (monotonic).
        self._adverts_read = -math.inf
        self._reading_adverts = asyncio.Lock()
        self.store = ManagerStore(settings)
        self.publisher = Publisher(settings, died=self._died)
        self.outbox = Outbox(self.store, self.publisher)
        #: Single creates of this process, written and published together (``orch_manager.intake``).
        self.creates = GroupCommit(self._create_rows, self.outbox.publish_now)
        holder = replica or new_holder_id()
        self.leadership = Leadership(
            self.store,
            loops=self._leader_loops(holder),
            timings=settings.lease_timings,
            clock=Clock(settings.clock_hook),
            name=LEADER_NAME,
            holder=holder,
        )
        #: What the database server's settings mean for the promise (``/healthz``).
        self.database = DatabaseFacts()
        #: What this replica acknowledged lately, made good after a failover that lost it.
        self.journal = Journal(self.store, self.outbox, on_lost=self.metrics.lost_creates.inc)
        #: Set when a supervised task died; ``error`` says why.
        self.fatal = asyncio.Event()
        self.error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def kind_spec(self, name: str) -> KindSpec | None:
        """The kind, from this manager's code or else from the services' adverts."""
        return self.kinds.get(name) or self.advertised.get(name)

    def all_kinds(self) -> dict[str, KindSpec]:
        return {**self.advertised, **self.kinds}

    def _offers(self, pool: str) -> Offer:
        """What a create in ``pool`` may name: what its services advertised, and in the default
        pool this manager's own kinds too."""
        offer = self.offered.get(pool, Offer())
        if pool != DEFAULT_POOL:
            return offer
        kinds = {name: set(versions) for name, versions in offer.kinds.items()}
        for name, spec in self.kinds.items():
            kinds.setdefault(name, set()).add(spec.version)
        return Offer(offer.every, kinds)

    def _offered(self, name: str, pool: str, version: str | None) -> KindSpec | None:
        """The kind if ``pool`` offers it (in ``version``, if named)."""
        offer = self._offers(pool)
        if version is None:
            return self.kind_spec(name) if offer.every or name in offer.kinds else None
        if version not in offer.kinds.get(name, ()):
            return None
        own = self.kinds.get(name)
        return (
            own
            if own is not None and own.version == version
            else self.versions.get((name, version))
        )

    async def kind(
        self, name: str, pool: str = DEFAULT_POOL, version: str | None = None
    ) -> KindSpec:
        """The kind a create names, among those its pool offers (in the version it pins, if
        any); the adverts are read again for one not found (one read for the misses that
        come together). Raises UnknownKind, naming what the pool offers (never the name asked
        for)."""
        spec = self._offered(name, pool, version)
        if spec is None:
            await self._adverts_since(time.monotonic())
            spec = self._offered(name, pool, version)
        if spec is not None:
            return spec
        offer = self._offers(pool)
        if pool == DEFAULT_POOL and self.kind_spec(name) is None:
            return get_kind(self.all_kinds(), name)
        if pool not in self.offered and pool != DEFAULT_POOL:
            known = ", ".join(sorted({*self.offered, DEFAULT_POOL}))
            raise UnknownKind(f"no service has joined pool {pool!r}; pools: {known}")
        if name in offer.kinds:
            there = ", ".join(sorted(offer.kinds[name]))
            raise UnknownKind(
                f"pool {pool!r} has no such version of kind {name!r}; it has: {there}"
            )
        offers = ", ".join(sorted(offer.kinds)) or "none"
        raise UnknownKind(f"pool {pool!r} offers no kind of that name; it offers: {offers}")

    async def _adverts_since(self, since: float) -> None:
        """The adverts as they were at ``since`` or later: read again, unless a read that
        began since then has ended meanwhile (creates that miss at once share one read)."""
        async with self._reading_adverts:
            if self._adverts_read < since:
                await self.read_adverts()

    async def fold_counts(self) -> None:
        # One statement (atomic alone), then the vacuum, which no transaction may hold.
        async with self.store.autocommit() as tx:
            if await repo.fold_counts(tx) >= VACUUM_AFTER:
                await repo.vacuum_counts(tx)

    async def read_adverts(self) -> None:
        """What the services advertised of their kinds: for those this manager has no code
        for, of each kind the advert of the newest service that runs it (a live one first),
        and of each version of each kind; what each pool offers; and what each service runs.
        An advert is another process's input: one that cannot be read (``adverts.read_advert``)
        is logged, naming its service, and left out; it never stops the manager."""
        began = time.monotonic()
        async with self.store.autocommit() as tx:
            found = await repo.adverts(tx)
            pools = await repo.pools(tx)
            holders = await repo.holder_kinds(tx)
        advertised: dict[str, KindSpec] = {}
        versions: dict[tuple[str, str], list[KindSpec]] = {}
        offered = {pool: Offer(every) for pool, every in pools.items()}
        for a in sorted(found, key=lambda a: (a.live, a.created_at), reverse=True):
            try:
                spec = advertised_spec(a.kind, a.text)
            except AdvertRefused as exc:
                self._refused(a.service, a.kind, exc)
                continue
            offered.setdefault(a.pool, Offer()).kinds.setdefault(a.kind, set()).add(spec.version)
            same = versions.setdefault((a.kind, spec.version), [])
            if all(
                s.params_schema != spec.params_schema or s.secret_params != spec.secret_params
                for s in same
            ):
                same.append(spec)  # two adverts of one version that differ: both mask
            if a.kind not in self.kinds:
                advertised.setdefault(a.kind, spec)
        self.advertised = advertised
        self.versions = {key: specs[0] for key, specs in versions.items()}
        self._all_versions = versions
        self.holders = holders
        self.offered = offered
        self._adverts_read = began

    def _refused(self, service: str, kind: str, exc: AdvertRefused) -> None:
        """Log a refused advert once per service, kind and reason (read again every 5 s)."""
        key = (service, kind, str(exc))
        if len(self._logged_refusals) > 10_000:
            self._logged_refusals.clear()
        if key not in self._logged_refusals:
            self._logged_refusals.add(key)
            log.warning(
                "service %s: its advert of kind %r is left out: %s", safe_text(service), kind, exc
            )

    async def know_holders(self, rows: Sequence[dict[str, Any]]) -> None:
        """Read the adverts again if one of ``rows`` is held by a service not known yet (it
        joined since the last read): its advert tells that observer's secrets."""
        holders = {r.get("service_id") for r in rows} - {None}
        if not holders.issubset(self.holders):
            # A read that began within the last second will do: a holder still unknown then
            # (its row pruned, say) is masked whole, and a burst of reads makes one query.
            await self._adverts_since(time.monotonic() - 1.0)

    def secrets_of(self, row: dict[str, Any]) -> list[KindSpec] | None:
        """What tells which params of observer ``row`` are secret: its own kind and version,
        that is the advert of the service that holds it, else of the version it is pinned
        to, else (nobody holds it, nor is it pinned) every version known of its kind; None
        where nothing tells (no advert read, a holder of a release before adverts, an
        advert refused), and the caller masks every value."""
        kind = row["kind"]
        holder = row.get("service_id")
        version = row.get("kind_version")
        if holder is not None:
            runs = self.holders.get(holder)
            version = runs.get(kind) if runs is not None else None
            if version is None:
                return None
        if version is not None:
            found = list(self._all_versions.get((kind, version), ()))
            own = self.kinds.get(kind)
            if own is not None and own.version == version and not found:
                found.append(own)
            return found or None
        every = [s for (k, _), specs in self._all_versions.items() if k == kind for s in specs]
        own = self.kinds.get(kind)
        return [*every, own] if own is not None else every or None

    async def _create_rows(
        self, new: Sequence[repo.NewObserver]
    ) -> tuple[list[dict[str, Any] | NameTaken], list[Pending]]:
        async with self.store.autocommit() as tx:  # one statement: rows, history, outbox
            return await repo.create_observers(tx, new)

    def _leader_loops(self, holder: str) -> dict[str, Loop]:
        s = self.settings
        # Directed starts go only to services whose lease outlives a renewal period.
        margin = s.lease_ttl / 2
        patience = max(s.lease_ttl, s.audit_grace)
        # Each transaction of a loop holds the lease while it runs: an old leader that missed
        # its lease's end (a stall) writes nothing after its successor's term began.
        store = self.store.fenced(
            functools.partial(
                repo.leader_fence, name=LEADER_NAME, holder=holder, idle=s.lease_ttl / 2
            )
        )
        sweeper = background.Sweeper(
            store,
            self.outbox,
            self.publisher,
            margin,
            metrics=self.metrics,
            # As long as the audit waits before it sends anew a start nobody took.
            requeue_grace=patience,
        )
        audit = background.Audit(
            store,
            self.outbox,
            self.publisher,
            grace=s.audit_grace,
            margin=margin,
            metrics=self.metrics,
            patience=patience,
            # A service's wait before its renewal reads a start directed to it and lost (a
            # renewal interval, ttl / 5 by default), the next renewal, and the audit's grace.
            directed=min(s.lease_ttl, 2 * s.lease_ttl / 5 + s.audit_grace),
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
        mover = Mover(
            store,
            self.outbox,
            self.publisher,
            margin,
            metrics=self.metrics,
            in_flight=s.move_in_flight,
            # As a rebalance's: longer than the leader's own recovery of a lost start.
            landing=2 * s.lease_ttl,
        )
        loops["mover"] = background.every(s.move_interval, mover.once, "mover")
        pruner = background.Pruner(
            store,
            keep=s.retention,
            keep_services=s.service_retention,
            max_events=s.max_events_per_observer,
        )
        loops["retention"] = background.every(s.prune_interval, pruner.once, "retention")
        loops["counts"] = background.every(FOLD_EVERY, self.fold_counts, "counts")
        if s.rebalance:
            rebalancer = Rebalancer(
                store,
                self.outbox,
                self.publisher,
                pace=s.rebalance_pace,
                min_age=s.rebalance_min_age,
                cooldown=s.rebalance_cooldown,
                # Longer than the leader's own recovery of a lost start (a lease, then a sweep
                # or an audit): a move not landed by then will not land as asked.
                landing=2 * s.lease_ttl,
                metrics=self.metrics,
                tolerance=s.rebalance_tolerance,
            )
            loops["rebalance"] = background.every(
                s.rebalance_interval, rebalancer.once, "rebalance"
            )
        return loops

    async def start(self) -> None:
        await self.store.open()
        if self.settings.require_synchronous_replication:
            await self._read_database()
            assert self.database.replication is not None
            self.database.replication.require(synchronous=True)
        await self.publisher.start()
        self._spawn(self.creates.run(), "group-commit")
        self._spawn(
            background.every(ADVERTS_EVERY, self.read_adverts, "kinds' adverts")(), "adverts"
        )
        self._spawn(
            background.every(0.1, self.outbox.delete_published, "outbox cleanup")(),
            "outbox-cleanup",
        )
        self._spawn(
            background.every(database_facts.EVERY, self._read_database, "database facts")(),
            "database-facts",
        )
        self._spawn(background.every(journal.EVERY, self.journal.once, "timeline")(), "timeline")
        if self.settings.metrics:
            self._spawn(self.metrics.keep_fresh(self.store), "metrics")
        if self.settings.background:
            self._spawn(self.leadership.run(), "leadership")

    async def _read_database(self) -> None:
        self.database = await database_facts.read(self.store)
        self.metrics.database(self.database)

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
        """Stop the tasks, give up the leadership, close the connections: each step bounded, a
        task that ignores its cancel logged with where it waits, and left behind."""
        for task in self._tasks:
            task.remove_done_callback(self._died)
            task.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)
            for task in stuck:
                where = io.StringIO()
                task.print_stack(file=where)
                log.error(
                    "%s still runs %.0f s after its cancel: left behind\n%s",
                    task.get_name(),
                    STOP_TIMEOUT,
                    where.getvalue(),
                )
        await self.outbox.stop()
        with contextlib.suppress(Transient, TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT):
                if self.settings.background:
                    await self.leadership.release()
                await self.outbox.delete_published()
        with contextlib.suppress(Transient):
            await self.publisher.close()
        await self.store.close()
