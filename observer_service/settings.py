"""Settings of one observer-service process (env prefix ORCH_)."""

from __future__ import annotations

from pydantic import Field, model_validator

from contracts.settings import CommonSettings, default_host


class ServiceSettings(CommonSettings):
    name: str = Field(default_factory=default_host, min_length=1, max_length=200)
    worker_count: int = Field(default=10, ge=1, le=65_535)
    #: How often the lease is renewed, seconds; default a fifth of the TTL.
    renew_interval: float | None = Field(default=None, gt=0)
    #: Safety margin: observers are stopped this long before the lease could expire in Postgres.
    fence_margin: float | None = Field(default=None, ge=0)
    #: How long a graceful stop waits for observers to finish, seconds.
    shutdown_timeout: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _timings(self) -> ServiceSettings:
        if self.renew_interval is None:
            self.renew_interval = self.lease_ttl / 5
        if self.fence_margin is None:
            self.fence_margin = min(1.0, self.lease_ttl / 5)
        if self.renew_interval + self.fence_margin >= self.lease_ttl:
            raise ValueError(
                "ORCH_RENEW_INTERVAL + ORCH_FENCE_MARGIN must be shorter than ORCH_LEASE_TTL"
            )
        return self

    @property
    def renew_every(self) -> float:
        assert self.renew_interval is not None
        return self.renew_interval

    @property
    def margin(self) -> float:
        assert self.fence_margin is not None
        return self.fence_margin
