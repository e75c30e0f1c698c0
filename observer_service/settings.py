"""Settings of one observer-service process (env prefix ORCH_)."""

from __future__ import annotations

from pydantic import Field

from orch_contracts.pools import DEFAULT_POOL, POOL_PATTERN
from orch_contracts.settings import CommonSettings, default_host


class ServiceSettings(CommonSettings):
    name: str = Field(default_factory=default_host, min_length=1, max_length=200)
    #: The pool it joins: it takes only observers created in that pool, from that pool's work
    #: queue.
    pool: str = Field(default=DEFAULT_POOL, pattern=POOL_PATTERN)
    worker_count: int = Field(default=10, ge=1, le=65_535)
    #: PostgreSQL connections its pool opens at most (its lease session is one more); unset:
    #: min(20, 2 + worker_count); 3 at least (the batchers of takes, checkpoints and releases
    #: each want one). Four are opened at start (fewer if this is lower). A fleet
    #: counts them against the server's ``max_connections`` (``docs/scaling.md``).
    db_pool_max: int | None = Field(default=None, ge=3, le=1000)
    #: How long a graceful stop waits for observers to finish, seconds. What has not stopped
    #: by then is not handed over; the process exits and others take it from there.
    shutdown_timeout: float = Field(default=10.0, gt=0)
    #: How often a service compares the rows it holds with what it runs, seconds.
    check_every: float = Field(default=30.0, gt=0)
    #: A step of kind code that blocks the event loop longer than this, seconds, is a stall: it
    #: counts against the copy's restart budget (one past the lease fails it at once).
    loop_stall: float = Field(default=2.0, gt=0)
    #: Bytes of records (as JSON) the service holds across all its copies, emitted and not
    #: yet confirmed by the broker: an ``emit`` past it waits for room.
    output_buffer_bytes: int = Field(default=256 << 20, ge=4 << 20)
    #: Verify mode: record what kind code did in this directory (``contracts/witness.py``).
    witness_dir: str | None = None
    #: In verify mode, also trace every allocation (``tracemalloc``) to write each kind's
    #: memory: it makes the whole process several times slower (``witnessing.py``). The soak
    #: turns it off and judges each process's memory from outside.
    witness_memory: bool = True
    #: Serve Prometheus metrics on this port (off when unset).
    metrics_port: int | None = Field(default=None, ge=0, le=65_535)
    #: The address the metrics port listens on: loopback unless set (``0.0.0.0`` where a
    #: Prometheus on another host, or another container or pod, scrapes it).
    metrics_host: str = "127.0.0.1"
    #: A metrics connection has this many seconds for its whole exchange, then is closed.
    metrics_timeout: float = Field(default=5.0, gt=0, le=300)
    #: Metrics connections open at once; one more is answered 503 and closed.
    metrics_max_connections: int = Field(default=16, ge=1, le=10_000)
    #: Warn at start when the broker is too old for the per-queue consumer timeout (``orch up``
    #: turns it off for its services: it warns once itself).
    broker_advice: bool = True
