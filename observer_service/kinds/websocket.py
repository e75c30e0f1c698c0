"""``websocket``: a subscription kept open for ever; every message it receives is emitted.

Connects to ``url`` (``ws://`` or ``wss://``) only where the egress policy of ``http_poll``
allows (``ORCH_HTTP_POLL_ALLOW``: public addresses on ports 80 and 443 by default; every
address the name resolves to is checked at every connect), sends each of ``subscribe`` after
every connect, and emits each message as ``{"received_at": <epoch seconds>, "data": <text>}``
(a binary frame: ``{"received_at": …, "data": <base64>, "binary": true}``). Its records commit
on their own every 5 ms (``commit_every``): a subscription has nothing to resume from, so a
crash loses at most the records of those last milliseconds, and never delivers one twice.

A connection that drops, a server that stops answering pings (``ping_interval``,
``ping_timeout``), a frame over ``max_size`` bytes (at most ``MAX_FRAME``, 768 KiB: the largest
binary frame whose base64 record ``emit`` carries): each closes the connection, and it connects
again after a backoff with jitter (``reconnect_base`` doubling to ``reconnect_max``, back to the
base after a connection that lasted a minute). A server that stays open and sends nothing is
caught by a ``progress_timeout`` in the observer's restart policy, when it declares one.
"""

from __future__ import annotations

import base64
import json
import random
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator
from pydantic_core import Url

from observer_service.context import ObserverContext
from observer_service.egress import EgressRefused
from observer_service.kinds.http_poll import REFUSED_AT_CREATE, HttpPollSettings
from orch_contracts.kinds import from_client, observer_kind
from orch_contracts.outputs import MAX_RECORD_BYTES, RecordTooLarge

#: A connection that lasted this long resets the backoff.
STEADY = 60.0


class WebsocketParams(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    url: str = Field(description="ws:// or wss://")
    subscribe: list[str | dict[str, Any] | list[Any]] = Field(
        default_factory=list,
        max_length=100,
        description="frames sent after each connect (a JSON value is sent as its text)",
    )
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, max_length=32, description="headers of the opening handshake"
    )
    ping_interval: float = Field(default=20.0, ge=0.5, le=3600)
    ping_timeout: float = Field(default=20.0, ge=0.5, le=3600)
    max_size: int = Field(default=1 << 20, ge=1024, le=64 << 20, description="bytes a message")
    open_timeout: float = Field(default=10.0, gt=0, le=300)
    compression: bool = Field(
        default=False,
        description="offer per-message deflate: less traffic, about 50 KiB more per subscription",
    )
    reconnect_base: float = Field(default=0.5, ge=0.01, le=60)
    reconnect_max: float = Field(default=30.0, ge=0.01, le=3600)

    @field_validator("url")
    @classmethod
    def _allowed(cls, value: str, info: ValidationInfo) -> str:
        url = Url(value)
        if url.scheme not in ("ws", "wss") or not url.host:
            raise ValueError("a websocket URL is ws://host/… or wss://host/…")
        port = url.port or (443 if url.scheme == "wss" else 80)
        try:
            HttpPollSettings().policy().check(url.host, port)
        except EgressRefused as exc:
            if from_client(info):
                raise ValueError(REFUSED_AT_CREATE) from None
            raise ValueError(str(exc)) from None
        return value


def frame(item: str | dict[str, Any] | list[Any]) -> str:
    return item if isinstance(item, str) else json.dumps(item)


#: The largest frame whose record ``emit`` carries: a binary frame is emitted base64-encoded,
#: 4 bytes for every 3, in a record of at most ``MAX_RECORD_BYTES`` (less its other fields).
MAX_FRAME = (MAX_RECORD_BYTES - 256) // 4 * 3


def record(message: str | bytes) -> dict[str, Any]:
    now = time.time()
    if isinstance(message, bytes):
        return {"received_at": now, "data": base64.b64encode(message).decode(), "binary": True}
    return {"received_at": now, "data": message}


@observer_kind("websocket", params=WebsocketParams, commit_every=0.005)
async def websocket(ctx: ObserverContext) -> None:
    """Keeps a websocket subscription open and emits every message it receives."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake, WebSocketException

    p: WebsocketParams = ctx.params
    url = Url(p.url)
    host = url.host or ""
    port = url.port or (443 if url.scheme == "wss" else 80)
    policy = HttpPollSettings().policy()
    delay = p.reconnect_base
    while True:
        opened = time.monotonic()
        try:
            addresses = await policy.addresses(host, port)
            ctx.ensure_alive()  # before the handshake and the subscribe frames go out
            async with connect(
                p.url,
                host=str(addresses[0]),
                port=port,
                server_hostname=host if url.scheme == "wss" else None,
                additional_headers={k: v.get_secret_value() for k, v in p.headers.items()},
                ping_interval=p.ping_interval,
                ping_timeout=p.ping_timeout,
                max_size=min(p.max_size, MAX_FRAME),
                compression="deflate" if p.compression else None,
                open_timeout=p.open_timeout,
                close_timeout=p.ping_timeout,  # a server that stopped answering is left then
            ) as ws:
                # Abandoned (its lease lost), this copy never runs its exit: the library's own
                # tasks would keep the subscription alive, answering pings, beside the next copy.
                forget = ctx.on_abandon(ws.transport.abort)
                try:
                    for item in p.subscribe:
                        ctx.ensure_alive()
                        await ws.send(frame(item))
                    ctx.logger.info("subscribed (%d frames sent)", len(p.subscribe))
                    async for message in ws:
                        await _emit(ctx, message)
                finally:
                    forget()
        except EgressRefused as exc:
            ctx.logger.warning("not connecting: %s", exc)
        except (OSError, TimeoutError, InvalidHandshake, WebSocketException) as exc:
            ctx.logger.warning("connection ended (%s: %s)", type(exc).__name__, exc)
        if time.monotonic() - opened >= STEADY:
            delay = p.reconnect_base
        await ctx.sleep(delay + random.uniform(0, p.reconnect_base))
        delay = min(p.reconnect_max, delay * 2)


async def _emit(ctx: ObserverContext, message: str | bytes) -> None:
    """Emit a message's record; one that is over the record limit once encoded (a text frame
    of control characters, each escaped in six bytes) is left out, with a warning and a record
    saying so, rather than failing the observer."""
    try:
        await ctx.emit(record(message))
    except RecordTooLarge:
        ctx.logger.warning(
            "a message of %d bytes is over the record limit once encoded: left out", len(message)
        )
        await ctx.emit({"received_at": time.time(), "left_out": True, "bytes": len(message)})
