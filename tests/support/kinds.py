"""Observer kinds used only by the tests (loaded with ORCH_KIND_MODULES=tests.support.kinds).

The ones that tick write the recorder's tick log, so the tests judge them from what really ran.
"""

from __future__ import annotations

import asyncio
import os
import time

from pydantic import BaseModel, ConfigDict, SecretStr

from observer_service import ObserverContext, RestartPolicy, observer_kind
from observer_service.kinds.recorder import write_tick


def _tick(directory: str | None, ctx: ObserverContext, count: int) -> None:
    ctx.witness("tick")
    if directory is not None:
        write_tick(directory, ctx, count)


class FlakyParams(BaseModel):
    fail_after: float = 0.0


@observer_kind(
    "always_fails", restart=RestartPolicy(max_restarts=2, base_delay=0.05, max_delay=0.2)
)
async def always_fails(ctx: ObserverContext) -> None:
    """Raises at once, every time."""
    await ctx.checkpoint({"attempt": (ctx.last_checkpoint or {}).get("attempt", 0) + 1})
    raise RuntimeError("boom")


class SlowStopParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Where it writes its tick log (none: it only ticks).
    dir: str | None = None
    interval: float = 0.05
    #: Seconds it goes on ticking after it was cancelled.
    stop_after: float = 1.0
    #: Never stop: swallow every cancellation.
    swallow: bool = False


@observer_kind("slow_stop", params=SlowStopParams)
async def slow_stop(ctx: ObserverContext) -> None:
    """Ticks; when cancelled, keeps ticking for ``stop_after`` seconds (or for ever) first, the
    way a kind that flushes a buffer or closes a websocket politely does."""
    p: SlowStopParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    try:
        while True:
            count += 1
            _tick(p.dir, ctx, count)
            if count == 1 or count % 10 == 0:
                await ctx.checkpoint({"count": count})
            await ctx.sleep(p.interval)
    except BaseException:
        until = time.monotonic() + p.stop_after
        while p.swallow or time.monotonic() < until:
            count += 1
            _tick(p.dir, ctx, count)
            try:
                await asyncio.sleep(p.interval)
            except BaseException:
                continue
        raise


class LateWriterParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Where it writes its tick log (none: it only ticks).
    dir: str | None = None
    interval: float = 0.05
    #: Seconds between ``ensure_alive()`` and the side effect (a pool acquire, a connect).
    gap: float = 0.05


@observer_kind("late_writer", params=LateWriterParams)
async def late_writer(ctx: ObserverContext) -> None:
    """Does what the README asks: ``ensure_alive()`` right before its side effect; but the
    side effect awaits something first (here ``gap`` seconds), and then writes its tick."""
    p: LateWriterParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    while True:
        ctx.ensure_alive()
        await asyncio.sleep(p.gap)
        count += 1
        _tick(p.dir, ctx, count)
        if count == 1 or count % 20 == 0:
            await ctx.checkpoint({"count": count})
        await ctx.sleep(p.interval)


class BlockerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds it blocks the event loop (synchronous code: a CPU loop, a blocking call).
    block: float = 3.0
    #: Seconds between two blocks.
    every: float = 1.0


@observer_kind(
    "blocker", params=BlockerParams, restart=RestartPolicy(max_restarts=2, base_delay=0.05)
)
async def blocker(ctx: ObserverContext) -> None:
    """Blocks the event loop for ``block`` seconds every ``every`` seconds."""
    p: BlockerParams = ctx.params
    while True:
        await ctx.sleep(p.every)
        time.sleep(p.block)  # noqa: ASYNC251 - blocking the loop is what it is for


class KeyedParams(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    #: A default, so that ``orch verify --kinds tests.support.kinds`` runs it too (it fails on
    #: its own error, which the verdict reports and does not count against the promise).
    api_key: SecretStr = SecretStr("verify-default-key")
    #: A secret by its type alone (its name is not one the generic masking knows).
    pin: SecretStr | None = None


@observer_kind(
    "quotes_its_key", params=KeyedParams, restart=RestartPolicy(max_restarts=2, base_delay=0.05)
)
async def quotes_its_key(ctx: ObserverContext) -> None:
    """Raises an error that quotes its secret param (a client library that says which key it
    was refused), and logs it too (a careless kind)."""
    key = ctx.params.api_key.get_secret_value()
    ctx.logger.info("calling upstream with key %s", key)
    raise RuntimeError(f"upstream refused key {key}")


class EmitterParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval: float = 0.02
    #: Records emitted per tick.
    per_tick: int = 1
    #: Ticks per checkpoint (``emitter``), which commits them.
    checkpoint_every: int = 5


@observer_kind("emitter", params=EmitterParams)
async def emitter(ctx: ObserverContext) -> None:
    """Emits ``{"n": n}``, n counting on from its checkpoint, and checkpoints n: the records
    it delivers are exactly 1, 2, 3 … with n equal to their seq, whatever crashed meanwhile."""
    p: EmitterParams = ctx.params
    n = int((ctx.last_checkpoint or {}).get("n", 0))
    ticks = 0
    while True:
        for _ in range(p.per_tick):
            n += 1
            await ctx.emit({"n": n, "epoch": ctx.epoch})
        ticks += 1
        if ticks % p.checkpoint_every == 0:
            await ctx.checkpoint({"n": n})
        await ctx.sleep(p.interval)


@observer_kind("auto_emitter", params=EmitterParams, commit_every=0.005)
async def auto_emitter(ctx: ObserverContext) -> None:
    """Emits ``{"at": time}`` and never checkpoints: its records commit on their own."""
    p: EmitterParams = ctx.params
    while True:
        for _ in range(p.per_tick):
            await ctx.emit({"at": time.time(), "epoch": ctx.epoch})
        await ctx.sleep(p.interval)


@observer_kind("silent", progress_timeout=1.0, restart=RestartPolicy(base_delay=0.05))
async def silent(ctx: ObserverContext) -> None:
    """Commits once, then nothing: restarted for no progress after a second, every time."""
    await ctx.checkpoint({"runs": int((ctx.last_checkpoint or {}).get("runs", 0)) + 1})
    await asyncio.Event().wait()


class FencedWriterParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: postgres, redis or http (empty: nothing, so that ``orch verify`` can run it idle).
    sink: str = ""
    #: The store: a PostgreSQL DSN, a Redis URL or an HTTP URL.
    target: str = ""
    #: The Redis list, or the PostgreSQL table, written.
    key: str = "fenced_writes"
    #: An egress allowlist for the HTTP sink.
    allow: str = ""
    interval: float = 0.02
    #: Write without the fence (to show what it prevents).
    unfenced: bool = False


@observer_kind("fenced_writer", params=FencedWriterParams)
async def fenced_writer(ctx: ObserverContext) -> None:
    """Writes ``(epoch, n)`` to its store every ``interval`` through the store's fence
    (``observer_service.sinks``), and checkpoints n."""
    from observer_service import sinks
    from observer_service.egress import EgressPolicy

    p: FencedWriterParams = ctx.params
    n = int((ctx.last_checkpoint or {}).get("n", 0))
    if not p.sink:
        while True:
            await ctx.sleep(p.interval)
    if p.sink == "postgres":
        import asyncpg

        conn = await asyncpg.connect(p.target)
        # Abandoned mid-transaction, its open transaction would hold the fence row's lock (and
        # the next copy's check behind it) until the process collected it.
        ctx.on_abandon(conn.terminate)
        fence = sinks.PostgresFence()
        await fence.create(conn)
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {p.key} "
            "(id bigserial PRIMARY KEY, observer_id uuid, epoch bigint, n bigint)"
        )

        async def write() -> None:
            async with conn.transaction():
                if not p.unfenced:
                    await fence.check(conn, ctx)
                await conn.execute(
                    f"INSERT INTO {p.key} (observer_id, epoch, n) VALUES ($1, $2, $3)",
                    ctx.observer_id,
                    ctx.epoch,
                    n,
                )

    elif p.sink == "redis":
        import redis.asyncio as aioredis

        client = aioredis.from_url(p.target)
        rfence = sinks.RedisFence(client, prefix=f"{p.key}:fence:")

        async def write() -> None:
            entry = f"{ctx.epoch}:{n}"
            if p.unfenced:
                await client.rpush(p.key, entry)
            else:
                await rfence.execute(ctx, "RPUSH", p.key, entry)

    else:
        from observer_service import egress

        policy = EgressPolicy.parse(p.allow)
        http = (
            egress.client(policy, timeout=60)
            if p.unfenced
            else sinks.fenced_client(ctx, policy, timeout=60)
        )

        async def write() -> None:
            headers = sinks.idempotency_key(ctx, n)
            r = await http.post(p.target, json={"epoch": ctx.epoch, "n": n}, headers=headers)
            r.raise_for_status()

    while True:
        ctx.ensure_alive()
        n += 1
        await write()
        await ctx.checkpoint({"n": n})
        await ctx.sleep(p.interval)


class BurnerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds of CPU each step computes for (its thread's CPU time, not the wall clock).
    burn: float = 0.02
    #: Seconds between two steps.
    every: float = 0.05


@observer_kind("burner", params=BurnerParams)
async def burner(ctx: ObserverContext) -> None:
    """Computes for ``burn`` seconds of CPU in each step, and checkpoints how many steps it made
    and the longest one on the wall clock: on a CPU it shares, a step takes many times its CPU
    time, waiting for the CPU."""
    p: BurnerParams = ctx.params
    state = ctx.last_checkpoint or {"steps": 0, "longest": 0.0}
    while True:
        began, cpu = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu < p.burn:
            pass
        state["longest"] = max(state["longest"], time.monotonic() - began)
        state["steps"] += 1
        await ctx.checkpoint(state)
        await ctx.sleep(p.every)


class VersionedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str
    interval: float = 0.05


class VersionedParamsV2(VersionedParams):
    """Version 2's params: one field more (its advertised schema differs from version 1's)."""

    label: str = ""


VERSION = os.environ.get("ORCH_TEST_KIND_VERSION", "1")


@observer_kind(
    "versioned",
    params=VersionedParamsV2 if VERSION == "2" else VersionedParams,
    version=VERSION,
)
async def versioned(ctx: ObserverContext) -> None:
    """A recorder whose version each service names (``ORCH_TEST_KIND_VERSION``): two services
    with two versions of one kind, as a rollout has them. Counts on from its checkpoint."""
    p: VersionedParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    while True:
        ctx.ensure_alive()
        count += 1
        write_tick(p.dir, ctx, count)
        await ctx.checkpoint({"count": count})
        await ctx.sleep(p.interval)


class PulseParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str
    #: A TCP server that sends a line now and then (the test's own).
    port: int
    checkpoint_every: int = 20


@observer_kind("pulse", params=PulseParams)
async def pulse(ctx: ObserverContext) -> None:
    """Ticks once for every line a server sends it, as a subscription does for every message:
    no timer of its own (its loop's clock may stand still while messages keep coming)."""
    p: PulseParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    first = count + 1
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        while await reader.readline():
            ctx.ensure_alive()
            count += 1
            write_tick(p.dir, ctx, count)
            if count == first or count % p.checkpoint_every == 0:
                await ctx.checkpoint({"count": count})
    finally:
        writer.close()
