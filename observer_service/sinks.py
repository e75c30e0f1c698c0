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
  middleware answers 409 to a stale token, which the client raises as ``Fenced``. It judges
  at the write, not at the headers: after the whole body is in, with the epoch compared and
  set atomically (``EpochStore``) and the app run under a per-observer lock, on the observer's
  canonical id (``parse_token``).

What none of them covers: a store written without the helper; and a receiver with several
replicas is fenced only as far as its ``EpochStore`` is shared (``RedisEpochs``) *and* its
write is fenced in its own transaction (``fencing_token`` with ``PostgresFence``): between the
shared compare-and-set and a write elsewhere, another replica's newer write may land first.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, NamedTuple, Protocol, cast

import httpx

from observer_service.egress import EgressPolicy, client
from orch_contracts.errors import Fenced

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
    observer) is created there on first use. Register ``ctx.on_abandon(conn.terminate)`` once
    it is open: a copy abandoned inside the transaction would hold the fence row's lock, and the
    next copy's check behind it, until its process collected it."""

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


class FencingToken(NamedTuple):
    """A fencing token as a receiver reads it: the observer (its canonical id) and the epoch.
    It is a ``Copy``: ``await PostgresFence().check(conn, token)`` fences a write inside the
    receiver's own transaction, atomically with it."""

    observer_id: uuid.UUID
    epoch: int


_EPOCH = re.compile(r"0|[1-9][0-9]{0,17}")


def parse_token(raw: str) -> FencingToken:
    """``<observer_id>:<epoch>``; ValueError for anything else. The id is read as a UUID and
    kept canonical (case, braces and ``urn:uuid:`` forms are one observer), the epoch in plain
    decimal digits (no sign, blank, ``_`` or other script's digits)."""
    observer, _, epoch = raw.rpartition(":")
    if not _EPOCH.fullmatch(epoch):
        raise ValueError("a fencing token's epoch is plain decimal digits")
    return FencingToken(uuid.UUID(observer), int(epoch))


def fencing_token(scope: dict[str, Any]) -> FencingToken | None:
    """The token ``FencingMiddleware`` admitted for this request (an ASGI scope, or a
    Starlette/FastAPI ``request.scope``): for a receiver that fences in its own transaction."""
    found = scope.get(SCOPE_KEY)
    return found if isinstance(found, FencingToken) else None


#: Where ``FencingMiddleware`` leaves the request's token in its ASGI scope.
SCOPE_KEY = "orch.fencing_token"


class EpochStore(Protocol):
    """The newest epoch seen per observer, kept where every replica of the receiver sees it."""

    async def advance(self, observer: str, epoch: int) -> int | None:
        """Atomically: the newest epoch seen for ``observer`` before (None: none), and the
        newest becomes ``max(that, epoch)``. One compare-and-set, never a get then a set."""
        ...


class MemoryEpochs:
    """An ``EpochStore`` of one process (the default): its check and its set have no await
    between them. ``data`` may be any mapping this process alone writes."""

    def __init__(self, data: MutableMapping[str, int] | None = None) -> None:
        self.data: MutableMapping[str, int] = {} if data is None else data

    async def advance(self, observer: str, epoch: int) -> int | None:
        seen = self.data.get(observer)
        if seen is None or epoch > seen:
            self.data[observer] = epoch
        return seen


_ADVANCE_LUA = """
local seen = redis.call('GET', KEYS[1])
if (not seen) or tonumber(ARGV[1]) > tonumber(seen) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return seen
"""


class RedisEpochs:
    """An ``EpochStore`` shared by replicas: one Lua script compares and sets on the server.
    ``client`` is a ``redis.asyncio`` client."""

    def __init__(self, client: Any, prefix: str = "orch:http-fence:") -> None:
        self.prefix = prefix
        self._script = client.register_script(_ADVANCE_LUA)

    async def advance(self, observer: str, epoch: int) -> int | None:
        seen = await self._script(keys=[f"{self.prefix}{observer}"], args=[epoch])
        return None if seen is None else int(seen)


class FencingMiddleware:
    """ASGI middleware for a service that receives fenced writes. A request carrying
    ``Orch-Fencing-Token`` is refused with 409 when its epoch is older than the newest seen for
    its observer, judged **at the write**: once its whole body is in (at most ``max_body``
    bytes, else 413), with the epoch compared and set in ``store`` atomically, and the app run
    under a per-observer lock of this process, so that no newer write of the same observer can
    land between the check and this one's. ``store``: an ``EpochStore`` (``MemoryEpochs`` by
    default: one process; ``RedisEpochs`` for replicas, whose writes should also be fenced in
    the receiver's own transaction: ``fencing_token(scope)`` with ``PostgresFence``). A request
    without the header passes (``require=True`` refuses it with 400)."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        store: EpochStore | MutableMapping[str, int] | None = None,
        *,
        require: bool = False,
        max_body: int = 16 << 20,
    ) -> None:
        self.app = app
        self.store: EpochStore = (
            cast(EpochStore, store)
            if _is_epoch_store(store)
            else MemoryEpochs(cast(MutableMapping[str, int] | None, store))
        )
        self.require = require
        self.max_body = max_body
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

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
            found = parse_token(raw.decode("latin-1"))
        except ValueError:
            await _answer(send, 400, b"a fencing token is <observer_id>:<epoch>")
            return
        body = await _whole_body(receive, self.max_body)
        if body is None:
            await _answer(send, 413, b"the body is too large")
            return
        observer = str(found.observer_id)
        async with self._turn(observer):
            seen = await self.store.advance(observer, found.epoch)
            if seen is not None and found.epoch < seen:
                await _answer(send, 409, b"stale fencing token", fenced=True)
                return
            await self.app({**scope, SCOPE_KEY: found}, _replay(body, receive), send)

    @contextlib.asynccontextmanager
    async def _turn(self, observer: str) -> AsyncIterator[None]:
        """This process's writes of one observer, one at a time (its lock forgotten once no
        request holds or waits for it)."""
        lock, users = self._locks.get(observer, (asyncio.Lock(), 0))
        self._locks[observer] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[observer]
            if users == 1:
                del self._locks[observer]
            else:
                self._locks[observer] = (lock, users - 1)


def _is_epoch_store(store: object) -> bool:
    return store is not None and callable(getattr(store, "advance", None))


async def _whole_body(receive: Any, limit: int) -> bytes | None:
    """The request's body, read to its end (None past ``limit`` bytes)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # the client left: the app sees what came
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A ``receive`` that gives the app the body read already, then what the server says."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return again


async def _answer(send: Any, status: int, body: bytes, *, fenced: bool = False) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    if fenced:
        headers.append((b"orch-fenced", b"stale"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
