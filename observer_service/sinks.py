"""Fenced writes to the user's own stores: a write that carries an epoch older than one already
seen for its observer is refused, atomically with the write, and raises ``Fenced``.

A copy frozen with a write on the wire (sent, not yet applied) wakes after another copy took
its observer over; the orchestrator cannot stop bytes already sent. The store can, when each
write carries the copy's epoch and the store keeps, per observer, the highest epoch it saw:

- **PostgreSQL** (``PostgresFence``): inside the user's transaction, one statement takes the
  fence row's lock and advances it, or finds a newer epoch there and refuses. A newer copy's
  transaction waits for an older one's to end and then wins; an older one that comes after a
  newer one's first fenced write is refused and rolled back by the caller.
- **Redis** (``RedisFence``): one Lua script checks and advances the fence key, then runs the
  command, all atomically on the server.
- **HTTP** (``fenced_client``, ``FencingMiddleware``): every request carries
  ``Orch-Fencing-Token: <observer_id>:<epoch>`` and ``Idempotency-Key: <observer_id>:<n>``
  (``n`` chosen by the caller, a record's seq say); a receiving service that mounts the
  middleware answers 409 to a stale token, which the client raises as ``Fenced``.

What none of them covers: a store written without the helper, and a receiver that keeps its
highest epochs in memory on several replicas (give ``FencingMiddleware`` a shared ``store``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import httpx

from contracts.errors import Fenced
from observer_service.egress import EgressPolicy, client

#: The HTTP headers of a fenced request.
TOKEN_HEADER = "Orch-Fencing-Token"
IDEMPOTENCY_HEADER = "Idempotency-Key"
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class Copy(Protocol):
    """What a fence needs of a copy: ``ctx`` is one."""

    @property
    def observer_id(self) -> uuid.UUID: ...

    @property
    def epoch(self) -> int: ...


def refuse_stale(observer_id: object, epoch: int, seen: int | None) -> None:
    """The one rule: an epoch older than the newest seen for the observer is refused."""
    if seen is not None and epoch < seen:
        raise Fenced(f"observer {observer_id}: epoch {epoch} is older than {seen}, already seen")


# ------------------------------------------------------------------------------ PostgreSQL
class PostgresFence:
    """``await fence.check(conn, ctx)`` first thing inside the transaction that writes::

        async with conn.transaction():
            await fence.check(conn, ctx)      # Fenced: the transaction is rolled back
            await conn.execute("INSERT INTO prices …")

    ``conn`` is an asyncpg connection of the user's own database; the fence table (one row per
    observer) is created there on first use."""

    def __init__(self, table: str = "orch_fences") -> None:
        if not _TABLE.match(table):
            raise ValueError("the fence table's name is a plain lower-case SQL name")
        self.table = table
        self._created: set[int] = set()

    async def create(self, conn: Any) -> None:
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self.table} "
            "(observer_id uuid PRIMARY KEY, epoch bigint NOT NULL)"
        )

    async def check(self, conn: Any, copy: Copy) -> None:
        if id(conn) not in self._created:
            await self.create(conn)
            self._created.add(id(conn))
        # The row's lock is held to the end of the caller's transaction: a concurrent newer
        # copy waits for it, then finds its own epoch the newest; an older one waits for a
        # newer one's, then finds a newer epoch and is refused.
        seen = await conn.fetchval(
            f"INSERT INTO {self.table} AS f (observer_id, epoch) VALUES ($1, $2) "
            "ON CONFLICT (observer_id) DO UPDATE SET epoch = GREATEST(f.epoch, EXCLUDED.epoch) "
            "RETURNING f.epoch",
            copy.observer_id,
            copy.epoch,
        )
        refuse_stale(copy.observer_id, copy.epoch, seen)


# ----------------------------------------------------------------------------------- Redis
_LUA = """
local seen = tonumber(redis.call('GET', KEYS[1]) or '-1')
local epoch = tonumber(ARGV[1])
if epoch < seen then
  return redis.error_reply('FENCED ' .. seen)
end
if epoch > seen then
  redis.call('SET', KEYS[1], epoch)
end
local command = {}
for i = 2, #ARGV do command[#command + 1] = ARGV[i] end
return redis.call(unpack(command))
"""


class RedisFence:
    """``await fence.execute(ctx, "SET", "price:btc", "101")``: the command runs only if the
    copy's epoch is not older than the newest seen for its observer (kept at
    ``<prefix><observer_id>``), in one script on the server. ``client`` is a ``redis.asyncio``
    client; on a Redis Cluster, keep the command's keys in the fence key's slot (a hash tag)."""

    def __init__(self, client: Any, prefix: str = "orch:fence:") -> None:
        self.client = client
        self.prefix = prefix
        self._script = client.register_script(_LUA)

    async def execute(self, copy: Copy, *command: Any) -> Any:
        from redis.exceptions import ResponseError

        key = f"{self.prefix}{copy.observer_id}"
        try:
            return await self._script(keys=[key], args=[copy.epoch, *command])
        except ResponseError as exc:
            if str(exc).startswith("FENCED"):
                seen = int(str(exc).split()[1])
                refuse_stale(copy.observer_id, copy.epoch, seen)
            raise


# ------------------------------------------------------------------------------------ HTTP
def token(copy: Copy) -> str:
    return f"{copy.observer_id}:{copy.epoch}"


def fenced_client(copy: Copy, policy: EgressPolicy, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client under the egress ``policy`` whose every request carries this copy's
    fencing token; a 409 answer naming a stale token raises ``Fenced``. Give each write its
    key: ``headers={IDEMPOTENCY_HEADER: f"{ctx.observer_id}:{seq}"}``
    (``idempotency_key``)."""

    async def refused(response: httpx.Response) -> None:
        if response.status_code == 409 and response.headers.get("Orch-Fenced") == "stale":
            raise Fenced(f"{response.request.url.host} refused epoch {copy.epoch} as stale")

    hooks = kwargs.pop("event_hooks", {})
    hooks = {**hooks, "response": [refused, *hooks.get("response", [])]}
    headers = {**kwargs.pop("headers", {}), TOKEN_HEADER: token(copy)}
    return client(policy, headers=headers, event_hooks=hooks, **kwargs)


def idempotency_key(copy: Copy, n: int) -> dict[str, str]:
    return {IDEMPOTENCY_HEADER: f"{copy.observer_id}:{n}"}


class FencingMiddleware:
    """ASGI middleware for a service that receives fenced writes: a request whose
    ``Orch-Fencing-Token`` names an epoch older than the newest seen for its observer is
    answered 409 before the app sees it. ``store`` keeps the newest epoch per observer (a dict
    in memory by default: one process; give several replicas a shared one). A request without
    the header passes (``require=True`` refuses it with 400)."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        store: MutableMapping[str, int] | None = None,
        *,
        require: bool = False,
    ) -> None:
        self.app = app
        self.store: MutableMapping[str, int] = {} if store is None else store
        self.require = require

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(TOKEN_HEADER.lower().encode())
        if raw is None:
            if self.require:
                await _answer(send, 400, b"a fencing token is required")
                return
            await self.app(scope, receive, send)
            return
        try:
            observer, _, epoch_text = raw.decode("latin-1").rpartition(":")
            uuid.UUID(observer)
            epoch = int(epoch_text)
        except ValueError:
            await _answer(send, 400, b"a fencing token is <observer_id>:<epoch>")
            return
        seen = self.store.get(observer)
        if seen is not None and epoch < seen:
            await _answer(send, 409, b"stale fencing token", fenced=True)
            return
        if seen is None or epoch > seen:
            self.store[observer] = epoch  # checked and advanced with no await between
        await self.app(scope, receive, send)


async def _answer(send: Any, status: int, body: bytes, *, fenced: bool = False) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    if fenced:
        headers.append((b"orch-fenced", b"stale"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
