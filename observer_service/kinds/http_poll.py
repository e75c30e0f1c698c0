"""``http_poll``: GETs a URL every ``interval`` seconds and checkpoints what changed and when.

Safe by default: it reads at most ``max_bytes`` of a body, follows at most ``max_redirects``
redirects, gives up after ``timeout``, and, where ``ORCH_HTTP_POLL_ALLOW`` names hosts
(``example.com``, ``*.example.com``), fetches from those hosts only, redirects included.
"""

from __future__ import annotations

import hashlib
import time

import httpx
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.kinds import RestartPolicy, observer_kind
from observer_service.context import ObserverContext


class HttpPollSettings(BaseSettings):
    """This kind's own settings (the same in the manager, which validates, and the services)."""

    model_config = SettingsConfigDict(env_prefix="ORCH_HTTP_POLL_", extra="ignore")

    #: Comma-separated hosts it may fetch from; ``*.example.com`` also matches subdomains.
    #: Empty: any host.
    allow: str = ""

    def allows(self, host: str) -> bool:
        patterns = [p.strip().lower() for p in self.allow.split(",") if p.strip()]
        if not patterns:
            return True
        host = host.lower().rstrip(".")
        return any(
            host == p or (p.startswith("*.") and (host.endswith(p[1:]) or host == p[2:]))
            for p in patterns
        )


class NotAllowed(Exception):
    """A host outside ``ORCH_HTTP_POLL_ALLOW``."""


class BodyTooLarge(Exception):
    pass


class HttpPollParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: AnyHttpUrl
    interval: float = Field(default=30.0, ge=0.1, le=86_400)
    timeout: float = Field(default=10.0, gt=0, le=300)
    max_bytes: int = Field(default=1 << 20, ge=1, le=64 << 20, description="body read at most")
    max_redirects: int = Field(default=5, ge=0, le=20)

    @field_validator("url")
    @classmethod
    def _allowed(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        if not HttpPollSettings().allows(url.host or ""):
            raise ValueError(f"host {url.host!r} is not in ORCH_HTTP_POLL_ALLOW")
        return url


async def fetch(client: httpx.AsyncClient, p: HttpPollParams) -> tuple[int, str]:
    """(status code, SHA-256 of the body), reading at most ``max_bytes`` of it."""
    digest = hashlib.sha256()
    size = 0
    async with client.stream("GET", str(p.url)) as response:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > p.max_bytes:
                raise BodyTooLarge(f"the body is larger than {p.max_bytes} bytes")
            digest.update(chunk)
        return response.status_code, digest.hexdigest()


def client_for(p: HttpPollParams) -> httpx.AsyncClient:
    settings = HttpPollSettings()

    async def check(request: httpx.Request) -> None:  # every request: redirects too
        if not settings.allows(request.url.host):
            raise NotAllowed(f"host {request.url.host!r} is not in ORCH_HTTP_POLL_ALLOW")

    return httpx.AsyncClient(
        timeout=p.timeout,
        follow_redirects=True,
        max_redirects=p.max_redirects,
        event_hooks={"request": [check]},
    )


@observer_kind("http_poll", params=HttpPollParams, restart=RestartPolicy(max_restarts=10))
async def http_poll(ctx: ObserverContext) -> None:
    """Polls a URL; checkpoints status code, content hash and the time of the last change."""
    params: HttpPollParams = ctx.params
    state = dict(ctx.last_checkpoint or {})
    async with client_for(params) as client:
        while True:
            status, digest = await fetch(client, params)
            if (state.get("status"), state.get("hash")) != (status, digest):
                state = {"status": status, "hash": digest, "changed_at": time.time()}
                await ctx.checkpoint(state)
            await ctx.sleep(params.interval)
