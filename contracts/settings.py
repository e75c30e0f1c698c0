"""Settings both processes share. Each process has its own subclass; all read ORCH_* variables
(only at the command line's edge: library classes take keyword arguments)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL

from orch_contracts import database_url as dburl
from orch_contracts.deadline import LeaseTimings
from orch_contracts.masking import mask
from orch_contracts.topology import QueueType, Topology


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ORCH_", extra="ignore", validate_default=True, hide_input_in_errors=True
    )

    database_url: str = "postgresql+asyncpg://postgres@127.0.0.1:5432/orchestrator"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    #: Prefix of every exchange and queue name on the broker.
    prefix: str = Field(default="orch", pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    #: Comma-separated import paths of modules that define observer kinds.
    kind_modules: str = ""
    #: Refuse to start unless the database replicates synchronously (``contracts/durability``):
    #: a failover then loses no acknowledged write.
    require_synchronous_replication: bool = False
    #: AMQP heartbeat, seconds: the broker requeues a silent consumer's deliveries after about
    #: one or two of them, and the client notices a dead broker after about three.
    amqp_heartbeat: int = Field(default=5, ge=1, le=600)
    queue_type: QueueType = "classic"
    #: Consumer timeout set on the work queue where the broker supports it (3.12+).
    consumer_timeout_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=60_000)
    #: Lease of a service (and of the manager leader), seconds.
    lease_ttl: float = Field(default=5.0, gt=0.5, le=300)
    #: How often leases are renewed, seconds; default a fifth of the TTL.
    renew_interval: float | None = Field(default=None, gt=0)
    #: Work stops this long before a lease could expire in Postgres, seconds; default
    #: min(1 s, TTL/5). It covers stopping the tasks and clock-rate drift, so it is never 0.
    fence_margin: float | None = Field(default=None, ge=0.01)
    #: Tests and `orch verify` only: a file that makes the monotonic clock lag (a simulated
    #: suspend).
    clock_hook: Path | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: ``text`` for people, ``json`` (one object a line) for log shippers.
    log_format: Literal["text", "json"] = "text"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        """Either multi-host form is accepted; what is kept is the canonical one
        (``orch_contracts.database_url``)."""
        try:
            return dburl.normalize(value)
        except dburl.BadDatabaseUrl as exc:
            raise ValueError(
                "ORCH_DATABASE_URL must look like postgresql://user@host:port/db (several hosts: "
                "postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write); it "
                f"{exc}: {mask(value)!r}"
            ) from None

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        urls = split_urls(value)
        bad = [u for u in urls if not u.startswith(("amqp://", "amqps://"))]
        if not urls or bad:
            raise ValueError(
                "ORCH_AMQP_URL must look like amqp://user:pass@host:port/vhost (or several, "
                f"comma-separated: the nodes of one cluster), got {mask(value)!r}"
            )
        return ",".join(urls)

    @model_validator(mode="after")
    def _timings(self) -> Self:
        if self.renew_interval is None:
            self.renew_interval = self.lease_ttl / 5
        if self.fence_margin is None:
            self.fence_margin = min(1.0, self.lease_ttl / 5)
        if self.renew_interval + self.fence_margin >= self.lease_ttl:
            raise ValueError(
                "ORCH_RENEW_INTERVAL + ORCH_FENCE_MARGIN must be shorter than ORCH_LEASE_TTL"
            )
        if self.renew_interval + self.fence_margin >= self.amqp_heartbeat:
            raise ValueError(
                "ORCH_RENEW_INTERVAL + ORCH_FENCE_MARGIN must be shorter than "
                "ORCH_AMQP_HEARTBEAT: a service paused for longer than a renewal waits for a "
                "fresh one before its observers go on, and must do so before the broker could "
                "have declared it gone"
            )
        return self

    @property
    def lease_timings(self) -> LeaseTimings:
        assert self.renew_interval is not None
        assert self.fence_margin is not None
        return LeaseTimings(self.lease_ttl, self.renew_interval, self.fence_margin)

    @property
    def url(self) -> URL:
        """The canonical URL (several hosts are ``host`` parameters, see ``database_url``)."""
        return dburl.parse(self.database_url)

    @property
    def asyncpg_dsn(self) -> str:
        """The database URL as plain asyncpg takes it."""
        return asyncpg_dsn(self.database_url)

    @property
    def amqp_urls(self) -> list[str]:
        """Every node's URL, each with the heartbeat unless it names one."""
        out = []
        for url in self.amqp_url.split(","):
            if "heartbeat=" not in url:
                url += f"{'&' if '?' in url else '?'}heartbeat={self.amqp_heartbeat}"
            out.append(url)
        return out

    @property
    def kind_module_list(self) -> list[str]:
        return [m.strip() for m in self.kind_modules.split(",") if m.strip()]

    @property
    def topology(self) -> Topology:
        return Topology(self.prefix)


def asyncpg_dsn(url: str) -> str:
    """A database URL as plain asyncpg takes it (several hosts in libpq's ``h1:p1,h2:p2``)."""
    return dburl.to_asyncpg(url)


def on_database(url: str, database: str) -> str:
    """The same servers and credentials, another database (canonical form)."""
    return dburl.with_database(url, database)


def split_urls(value: str) -> list[str]:
    """The URLs of a comma-separated list, blanks dropped."""
    return [u.strip() for u in value.split(",") if u.strip()]


def where(url: str) -> str:
    """Host, port and path of a URL, without its credentials."""
    rest = url.partition("://")[2]
    return rest.rpartition("@")[2] or rest


def default_host() -> str:
    return socket.gethostname()
