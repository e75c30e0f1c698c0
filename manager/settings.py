"""Settings of one manager process (env prefix ORCH_)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from orch_contracts.settings import CommonSettings


class ManagerSettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65_535)
    #: Processes serving the port, each a full replica (API and a leadership candidate).
    workers: int = Field(default=1, ge=1, le=64)
    #: API tokens: ``name:role:sha256-hex`` entries (comma- or newline-separated), or
    #: ``@file`` with one a line. Make one with ``orch token new NAME --role admin``.
    api_tokens: str = ""
    #: ``disabled`` lets anyone call the API: for local development only.
    auth: Literal["on", "disabled"] = "on"
    #: Largest request body accepted, bytes.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    #: Largest body of ``POST /observers/batch`` (up to 1,000 observers), bytes.
    max_batch_body_bytes: int = Field(default=16 << 20, ge=1024)
    #: A request body must arrive within this many seconds (408 otherwise).
    body_timeout: float = Field(default=10.0, gt=0, le=300)
    #: Largest request head (request line and headers), bytes: 431 past it.
    max_header_bytes: int = Field(default=32 << 10, ge=1024, le=1 << 20)
    #: Most header fields in one request: 431 past it.
    max_headers: int = Field(default=100, ge=10, le=10_000)
    #: A request head must arrive within this many seconds of the connection (or of its first
    #: byte after a response): 408 and the connection closed otherwise (a slowloris).
    header_timeout: float = Field(default=10.0, gt=0, le=300)
    #: An idle keep-alive connection is closed after this many seconds.
    keep_alive_timeout: int = Field(default=5, ge=1, le=300)
    #: An answer the client takes nothing of for this many seconds (its write buffer full)
    #: ends the connection.
    send_timeout: float = Field(default=30.0, gt=0, le=3600)
    #: Connections one manager process holds at once (each of ORCH_WORKERS): one more is
    #: answered 503 and closed before anything of it is read.
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)
    #: Addresses (or networks) of the proxies whose X-Forwarded-For and X-Forwarded-Proto are
    #: believed, comma-separated; ``*`` for any. Empty (the default): nobody's, loopback
    #: included: the client is the peer of the TCP connection.
    forwarded_allow_ips: str = ""
    #: Serve Swagger UI at /docs and ReDoc at /redoc, with their files under /docs/assets/ (the
    #: manager serves them itself: no CDN, they work offline). Off by default. /openapi.json is
    #: served either way, with no token.
    api_docs: bool = False
    #: The last ``orch verify`` report (its ``--report``), served at /verify-report and linked
    #: from the console when the file exists. A path relative to the manager's directory.
    verify_report: Path | None = Path("orch-verify-report.html")
    #: Largest ``params`` of one observer (as JSON), bytes.
    max_params_bytes: int = Field(default=64 << 10, ge=64)
    #: How often the leader looks for dead services, seconds.
    sweep_interval: float = Field(default=0.25, gt=0)
    #: Outbox rows older than this are published by the leader's relay (the API publishes its
    #: own rows at once; the relay is for a manager that crashed in between), seconds.
    relay_grace: float = Field(default=2.0, ge=0)
    relay_interval: float = Field(default=0.5, gt=0)
    #: How often the leader looks for live observers whose start message is stuck or lost.
    audit_interval: float = Field(default=0.25, gt=0)
    #: An observer nobody holds for this long, while the work queue has nothing ready, has its
    #: message stuck at an unresponsive consumer (or lost): it is re-dispatched, seconds.
    audit_grace: float = Field(default=0.5, gt=0)
    #: Move running observers to services that have fewer than their fair share.
    rebalance: bool = True
    rebalance_interval: float = Field(default=1.0, gt=0)
    #: Fraction of the running observers in motion at once (at least one).
    rebalance_pace: float = Field(default=0.1, gt=0, le=1)
    #: Nothing moves while every service runs within this fraction of its fair share (a
    #: rebalance that began, with a service outside it, goes on to the exact shares).
    rebalance_tolerance: float = Field(default=0.05, ge=0, lt=1)
    #: A service receives moved observers only once it has lived this long, seconds.
    rebalance_min_age: float = Field(default=10.0, ge=0)
    #: An observer moved by a rebalance is not moved again within this many seconds.
    rebalance_cooldown: float = Field(default=600.0, ge=0)
    #: How often the leader hands over running observers that were moved (``POST
    #: /observers/move``) and cannot run where they are, seconds.
    move_interval: float = Field(default=0.5, gt=0)
    #: Moved observers in motion at once, at most: a move of thousands is handed over at this
    #: pace, each from its checkpoint.
    move_in_flight: int = Field(default=100, ge=1, le=100_000)
    #: Deleted observers (and their history) are kept this long, seconds (default 7 days).
    retention: float = Field(default=7 * 86_400, ge=60)
    #: Dead service rows are kept this long, seconds (default a day).
    service_retention: float = Field(default=86_400, ge=60)
    #: History rows kept per observer (the newest).
    max_events_per_observer: int = Field(default=1000, ge=10, le=1_000_000)
    prune_interval: float = Field(default=60.0, gt=0)
    #: Run the elected background loops in this process (off for a pure API replica).
    background: bool = True
    #: Log one line per request (method, path, status, time, who).
    access_log: bool = False
    #: Serve Prometheus metrics at /metrics and measure requests.
    metrics: bool = True
    #: ``open``: /metrics needs no token, and shows services by name only (a service id is
    #: shown to a caller with a valid token). ``token``: /metrics needs a token (any role).
    metrics_auth: Literal["open", "token"] = "open"
    #: The database figures at /metrics are read this often (seconds) while /metrics is
    #: scraped, and not at all while it is not.
    metrics_refresh: float = Field(default=5.0, ge=1)

    @property
    def forwarded_allow_list(self) -> list[str]:
        return [e.strip() for e in self.forwarded_allow_ips.split(",") if e.strip()]

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _forwarded(cls, value: str) -> str:
        for entry in (e.strip() for e in value.split(",")):
            if entry and entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ValueError(
                        f"{entry!r} is not an address or a network (ORCH_FORWARDED_ALLOW_IPS is "
                        "a comma-separated list of them, or *)"
                    ) from None
        return value

    @model_validator(mode="after")
    def _auth(self) -> Self:
        from orch_manager.auth import parse_tokens

        if self.auth == "on" and not parse_tokens(self.api_tokens):
            raise ValueError(
                "ORCH_API_TOKENS is empty, so nobody could call the API: make a token with "
                "`orch token new NAME --role admin`, or set ORCH_AUTH=disabled for local "
                "development"
            )
        return self
