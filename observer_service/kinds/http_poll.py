"""``http_poll``: GETs a URL every ``interval`` seconds and checkpoints what changed and when."""

from __future__ import annotations

import hashlib
import time

import httpx
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field

from contracts.kinds import RestartPolicy, observer_kind
from observer_service.context import ObserverContext


class HttpPollParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: AnyHttpUrl
    interval: float = Field(default=30.0, ge=0.1, le=86_400)
    timeout: float = Field(default=10.0, gt=0, le=300)


@observer_kind("http_poll", params=HttpPollParams, restart=RestartPolicy(max_restarts=10))
async def http_poll(ctx: ObserverContext) -> None:
    """Polls a URL; checkpoints status code, content hash and the time of the last change."""
    params: HttpPollParams = ctx.params
    state = dict(ctx.last_checkpoint or {})
    async with httpx.AsyncClient(timeout=params.timeout, follow_redirects=True) as client:
        while True:
            response = await client.get(str(params.url))
            digest = hashlib.sha256(response.content).hexdigest()
            now = time.time()
            if (state.get("status"), state.get("hash")) != (response.status_code, digest):
                state = {"status": response.status_code, "hash": digest, "changed_at": now}
                await ctx.checkpoint(state)
            await ctx.sleep(params.interval)
