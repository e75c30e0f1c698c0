"""The manager's Prometheus metrics (``GET /metrics``).

Counters of what this replica did (re-dispatches, moves, sweeps, requests) are counted as it
happens. The state of the cluster (observers by status and kind, services, outbox) is read from
the database by a task of its own (``keep_fresh``), every ``ORCH_METRICS_REFRESH`` seconds while
this replica is scraped, and not at all while it is not: a scrape renders what was last read and
never waits on the database (but the first, for its first read). Every replica shows the same
cluster. No observer id is ever a label, and a
service's id is one only for a caller with a token (``render``): that id is what a broker
control message names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orch_contracts import __version__
from orch_contracts.errors import Transient
from orch_contracts.metrics import Metrics
from orch_manager import repository as repo
from orch_manager.database_facts import DatabaseFacts
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)

#: After a scrape, the cluster's state is read on for this long (seconds), at least two
#: refreshes: a scraper's usual interval (15 s to a minute) keeps it read without a gap.
SCRAPED_FOR = 120.0
#: The first scrape waits this long at most for the first read (seconds), then renders what
#: this replica counted itself.
FIRST_READ_WAIT = 5.0


class ManagerMetrics(Metrics):
    def __init__(self, *, refresh: float = 5.0) -> None:
        super().__init__()
        m = self
        self.refresh_every = refresh
        self._scraped = -float("inf")
        self._wanted = asyncio.Event()
        self._read_once = asyncio.Event()
        Info("orch_manager", "This manager replica", registry=m.registry).info(
            {"version": __version__}
        )
        self.http = m.histogram(
            "orch_http_request_duration_seconds",
            "Time to answer an API request, by route template, method and status code",
            "route",
            "method",
            "code",
        )
        self.observers = m.gauge(
            "orch_observers", "Observers, by status, kind and pool", "status", "kind", "pool"
        )
        self.pool_capacity = m.gauge(
            "orch_pool_capacity", "Slots of each pool's live services taking work", "pool"
        )
        self.pool_running = m.gauge(
            "orch_pool_running", "Observers each pool's live services hold", "pool"
        )
        self.services = m.gauge("orch_services", "Live services, by state", "state")
        per_service = ("service", "service_id")
        self.capacity = m.gauge(
            "orch_service_capacity", "worker_count of each live service", *per_service
        )
        self.running = m.gauge(
            "orch_service_running", "Observers each live service holds", *per_service
        )
        self.lease_age = m.gauge(
            "orch_service_heartbeat_age_seconds",
            "Seconds since each live service renewed its lease",
            *per_service,
        )
        self._by_name = _ByName(
            self.registry,
            summed={"orch_service_capacity", "orch_service_running"},
            oldest={"orch_service_heartbeat_age_seconds"},
        )
        self.outbox_backlog = m.gauge("orch_outbox_backlog", "Outbox records not yet confirmed")
        self.queue_ready = m.gauge(
            "orch_work_queue_ready",
            "Start messages ready in each pool's work queue: observers waiting for a free slot "
            "(the leader's view, read by its audit each pass; 0 on other replicas)",
            "pool",
        )
        self.queue_ready.labels("default").set(0)
        self.outbox_age = m.gauge(
            "orch_outbox_oldest_age_seconds", "Age of the oldest outbox record (0 when empty)"
        )
        self.oldest_output = m.gauge(
            "orch_outputs_oldest_unconfirmed_seconds",
            "Age of the oldest committed output not yet confirmed by the broker (the leader's "
            "view, 0: none)",
        )
        self.outputs_relayed = m.counter(
            "orch_outputs_relayed_total", "Outputs the leader published for gone services"
        )
        self.leader = m.gauge("orch_leader", "1 while this replica leads, else 0")
        self.redispatches = m.counter(
            "orch_redispatches_total",
            "Observers re-dispatched by the leader, by reason (holder_gone, stuck, kind_found)",
            "reason",
        )
        self.moves = m.counter(
            "orch_moves_total", "Observers asked to move, by reason (rebalance, drain)", "reason"
        )
        self.durability = m.gauge(
            "orch_database_durability",
            "1 for what a failover of the database can lose: synchronous (nothing acknowledged), "
            "asynchronous (the standbys' lag), single (no standby), standby (read-only)",
            "mode",
        )
        self.replication_lag = m.gauge(
            "orch_database_replication_lag_seconds",
            "How far the slowest standby's replay lags (-1: no standby, or unknown)",
        )
        self.timeline = m.gauge(
            "orch_database_timeline", "The database's WAL timeline (a failover raises it)"
        )
        self.lost_creates = m.counter(
            "orch_failover_lost_creates_total",
            "Acknowledged creates a failover of the database lost (manager/journal.py)",
        )
        self.swept = m.counter(
            "orch_services_swept_total",
            "Services the sweeper found dead, by how (lease_expired, process_gone)",
            "how",
        )

    def database(self, facts: DatabaseFacts) -> None:
        """What a failover of the database can lose, as last read (``database_facts``)."""
        r = facts.replication
        if r is None:
            return
        self.durability.clear()
        self.durability.labels(r.durability).set(1)
        self.replication_lag.set(-1 if r.lag is None else r.lag)
        if r.timeline is not None:
            self.timeline.set(r.timeline)

    def observe_request(self, route: str, method: str, code: int, seconds: float) -> None:
        self.http.labels(route, method, str(code)).observe(seconds)

    async def scraped(self, *, leads: bool) -> None:
        """A scrape: the cluster's state is read on from now (``keep_fresh``); the first waits
        for its first read, ``FIRST_READ_WAIT`` at most."""
        self.leader.set(1 if leads else 0)
        self._scraped = time.monotonic()
        self._wanted.set()
        if not self._read_once.is_set():
            try:
                await asyncio.wait_for(self._read_once.wait(), FIRST_READ_WAIT)
            except TimeoutError:
                log.warning("metrics: no read of the cluster's state yet; rendered without it")

    async def keep_fresh(self, store: ManagerStore) -> None:
        """Read the cluster's state every ``refresh_every`` seconds while scraped (within
        ``SCRAPED_FOR``); an unavailable database is logged, and what was read is kept."""
        while True:
            await self._wanted.wait()
            try:
                await self.read(store)
            except Transient as exc:
                log.warning("metrics: cluster state not read: %s", exc)
            else:
                self._read_once.set()
            if time.monotonic() - self._scraped > max(SCRAPED_FOR, 2 * self.refresh_every):
                self._wanted.clear()
            await asyncio.sleep(self.refresh_every)

    async def read(self, store: ManagerStore) -> None:
        """Read the cluster's state from the database."""
        async with store.autocommit() as tx:
            state = await repo.cluster_state(tx)
        self.observers.clear()
        for row in state.observers:
            self.observers.labels(row.status, row.kind, row.pool).set(row.n)
        self.services.clear()
        services = state.services
        self.services.labels("taking_work").set(sum(1 for s in services if not s.draining))
        self.services.labels("draining").set(sum(1 for s in services if s.draining))
        for gauge in (self.capacity, self.running, self.lease_age, self.pool_capacity):
            gauge.clear()
        self.pool_running.clear()
        for pool in {s.pool for s in services}:
            of_pool = [s for s in services if s.pool == pool]
            self.pool_capacity.labels(pool).set(
                sum(s.worker_count for s in of_pool if not s.draining)
            )
            self.pool_running.labels(pool).set(sum(s.running for s in of_pool))
        for s in services:
            labels = (s.name, str(s.id))
            self.capacity.labels(*labels).set(s.worker_count)
            self.running.labels(*labels).set(s.running)
            self.lease_age.labels(*labels).set(s.heartbeat_age)
        self.outbox_backlog.set(state.outbox_backlog)
        self.outbox_age.set(state.outbox_age or 0.0)

    def render(self, *, service_ids: bool = True) -> bytes:
        """The exposition; without ``service_ids``, each service's series by its name only."""
        return generate_latest(self.registry if service_ids else self._by_name)


class _ByName(Collector):
    """A registry's metrics with the ``service_id`` label dropped: two live services of one name
    are one series (their capacity and what they run added up, the older lease shown)."""

    def __init__(self, registry: CollectorRegistry, *, summed: set[str], oldest: set[str]) -> None:
        self.registry = registry
        self.summed = summed
        self.oldest = oldest

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name not in self.summed | self.oldest:
                yield family
                continue
            by_name: dict[str, float] = {}
            for sample in family.samples:
                name, value = sample.labels.get("service", ""), sample.value
                if name in by_name:
                    value = (
                        by_name[name] + value
                        if family.name in self.summed
                        else max(by_name[name], value)
                    )
                by_name[name] = value
            out = GaugeMetricFamily(family.name, family.documentation, labels=["service"])
            for name, value in sorted(by_name.items()):
                out.add_metric([name], value)
            yield out
