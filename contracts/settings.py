"""Settings both processes share. Each process has its own subclass; all read ORCH_* variables."""

from __future__ import annotations

import socket

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.topology import QueueType, Topology


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORCH_", extra="ignore", validate_default=True)

    database_url: str = "postgresql+asyncpg://postgres@127.0.0.1:5432/orchestrator"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    #: Prefix of every exchange and queue name on the broker.
    prefix: str = Field(default="orch", pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    #: Comma-separated import paths of modules that define observer kinds.
    kind_modules: str = ""
    #: AMQP heartbeat, seconds: the broker requeues a silent consumer's deliveries after about
    #: two of them, and the client notices a dead broker after about three.
    amqp_heartbeat: int = Field(default=5, ge=1, le=600)
    queue_type: QueueType = "classic"
    #: Consumer timeout set on the work queue where the broker supports it (3.12+).
    consumer_timeout_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=60_000)
    #: Lease of a service (and of the manager leader), seconds.
    lease_ttl: float = Field(default=5.0, gt=0.5, le=300)

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("postgresql", "postgres", "postgresql+asyncpg"):
            raise ValueError(
                f"ORCH_DATABASE_URL must look like postgresql://user@host:port/db, got {value!r}"
            )
        return f"postgresql+asyncpg://{rest}"

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        if not value.startswith(("amqp://", "amqps://")):
            raise ValueError(
                f"ORCH_AMQP_URL must look like amqp://user:pass@host:port/vhost, got {value!r}"
            )
        return value

    @property
    def asyncpg_dsn(self) -> str:
        """The database URL as plain asyncpg takes it."""
        return "postgresql://" + self.database_url.partition("://")[2]

    @property
    def amqp_url_with_heartbeat(self) -> str:
        if "heartbeat=" in self.amqp_url:
            return self.amqp_url
        sep = "&" if "?" in self.amqp_url else "?"
        return f"{self.amqp_url}{sep}heartbeat={self.amqp_heartbeat}"

    @property
    def kind_module_list(self) -> list[str]:
        return [m.strip() for m in self.kind_modules.split(",") if m.strip()]

    @property
    def topology(self) -> Topology:
        return Topology(self.prefix)


def default_host() -> str:
    return socket.gethostname()
