"""The ``websocket`` kind under failover, judged by the websocket server it subscribes to.

200 ``websocket`` observers on 3 services subscribe to a real websocket server the test starts
(the ``websockets`` library's own), each on a path of its own (``/feed/<name>``). The server
records every subscription of an observer as an interval of its own clock: from the subscribe
frame received to the connection closed. One service is SIGKILLed, then another is frozen
(SIGSTOP) past its lease and woken. From the server's records alone: no observer ever has two
subscriptions live at once, and every moved observer subscribed again within the failover
targets (a crash: seconds; a freeze: the lease TTL plus 2 s).

What "live" means, and why the lease is 5 s here. A frozen client cannot close anything; its
TCP connection stays open until the server closes it. The server runs websockets' keepalive
(``PING_INTERVAL``, ``PING_TIMEOUT``) and a short ``CLOSE_TIMEOUT``, so that it drops a client
that stopped answering within ``DETECTION`` seconds: a subscription is live until then. The
orchestrator promises that a successor starts only after the frozen holder's lease expired, at
least ``LEASE_TTL`` minus a renewal interval after the freeze; with a 5 s lease (renewed every
second) that is 4 s, well after the server dropped the frozen copy (2 s at most, plus a noisy
machine's delays). A lease shorter than the server's detection time would let the successor
subscribe while the frozen copy's connection is still open, which no orchestrator can prevent
(nothing reaches a stopped process), and the test would judge the server's settings, not the
orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from websockets.asyncio.server import Server, ServerConnection, broadcast, serve
from websockets.exceptions import ConnectionClosed

from orch.cluster import free_port
from tests.support.cluster import Cluster, Proc, wait_for

#: Every test here needs processes of its own (faults, or what one process holds).
pytestmark = pytest.mark.processes

OBSERVERS = 200
#: Every service can hold every observer: after a crash and a freeze one service holds them all.
WORKERS = OBSERVERS
LEASE_TTL = 5.0
#: The server's keepalive: it pings every PING_INTERVAL, fails a connection whose pong is
#: PING_TIMEOUT late, and closes the socket CLOSE_TIMEOUT after its close frame went unanswered.
PING_INTERVAL = 0.5
PING_TIMEOUT = 1.0
CLOSE_TIMEOUT = 0.5
#: How long a frozen client's subscription stays live at the server at most.
DETECTION = PING_INTERVAL + PING_TIMEOUT + CLOSE_TIMEOUT
#: How often the server pushes a message to every subscription (each one becomes a record).
PUSH_EVERY = 0.25
#: Back after a crash: the dead service's connections close at once and its observers are
#: re-dispatched without waiting for its lease; generous for a loaded 2-core machine.
KILL_BOUND = 5.0
#: Back after a freeze, counted from the SIGSTOP: the lease TTL plus 2 s (the failover target),
#: plus the server's detection time as slack for this noisy machine.
FREEZE_BOUND = LEASE_TTL + 2.0 + DETECTION


def subscribe_frame(name: str) -> dict[str, str]:
    return {"op": "subscribe", "observer": name}


@dataclass
class Subscription:
    """One subscription as the server saw it, in its monotonic clock."""

    start: float  # the subscribe frame received
    connection: StampedConnection
    end: float | None = None  # the connection closed (None: still open)

    @property
    def live(self) -> bool:
        return self.end is None


class StampedConnection(ServerConnection):
    """A server connection that notes when its socket was closed (``connection_lost``)."""

    lost_at: float | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_at = time.monotonic()
        super().connection_lost(exc)


@dataclass
class FeedServer:
    """A websocket server recording, per observer (its path ``/feed/<name>``), every
    subscription: [subscribe frame received, connection closed]."""

    port: int
    #: None: no keepalive, so a frozen client stays connected across its successor's subscribe
    #: and the overlap check fails (how this test was checked to be able to fail).
    ping_interval: float | None = PING_INTERVAL
    subs: dict[str, list[Subscription]] = field(default_factory=lambda: defaultdict(list))
    #: When a subscription last started or ended.
    changed_at: float = field(default_factory=time.monotonic)
    strays: list[str] = field(default_factory=list)
    _server: Server | None = None
    _pusher: asyncio.Task[None] | None = None

    async def _handler(self, ws: ServerConnection) -> None:
        assert isinstance(ws, StampedConnection)
        path = ws.request.path if ws.request else ""
        name = path.removeprefix("/feed/")
        if not path.startswith("/feed/") or not name:
            self.strays.append(path)
            await ws.close(1008, "no such feed")
            return
        sub: Subscription | None = None
        try:
            async for message in ws:  # ends quietly on a clean close
                if sub is None and message == json.dumps(subscribe_frame(name)):
                    sub = Subscription(time.monotonic(), ws)
                    self.subs[name].append(sub)
                    self.changed_at = sub.start
                elif sub is None:
                    self.strays.append(f"{path}: {message!r}")
        except ConnectionClosed:
            pass  # a dead client, or one the keepalive failed: what this test is about
        finally:
            await ws.wait_closed()
            if sub is not None:
                assert ws.lost_at is not None
                sub.end = ws.lost_at
                self.changed_at = time.monotonic()

    async def _push(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(PUSH_EVERY)
            n += 1
            live = [s.connection for subs in self.subs.values() for s in subs if s.live]
            broadcast(live, f"tick {n}")

    async def start(self) -> None:
        self._server = await serve(
            self._handler,
            "127.0.0.1",
            self.port,
            create_connection=StampedConnection,
            ping_interval=self.ping_interval,
            ping_timeout=PING_TIMEOUT,
            close_timeout=CLOSE_TIMEOUT,
            backlog=1024,  # 200 clients connect at once after a failover
        )
        self._pusher = asyncio.create_task(self._push())

    async def stop(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ------------------------------------------------------------------ what it saw
    def live(self) -> dict[str, int]:
        """Per observer, its subscriptions live now (observers with none are left out)."""
        counts = {name: sum(1 for s in subs if s.live) for name, subs in self.subs.items()}
        return {name: n for name, n in counts.items() if n}

    def one_each(self, names: list[str]) -> bool:
        return not self.not_one_each(names)

    def not_one_each(self, names: list[str]) -> dict[str, int]:
        """The observers of ``names`` without exactly one live subscription, and others with
        any: their live subscriptions."""
        live = self.live()
        wrong = {n: live.get(n, 0) for n in names if live.get(n, 0) != 1}
        return wrong | {n: k for n, k in live.items() if n not in names}

    def subscribed_since(self, names: set[str], at: float) -> bool:
        """Every one of ``names`` subscribed after ``at`` and is live on it."""
        return all(any(s.start >= at and s.live for s in self.subs[n]) for n in names)

    def overlaps(self) -> dict[str, list[tuple[float, float | None, float]]]:
        """Per observer, each subscription that started while an earlier one was still live:
        (the earlier one's start, its end, the later one's start)."""
        found: dict[str, list[tuple[float, float | None, float]]] = {}
        for name, subs in self.subs.items():
            ordered = sorted(subs, key=lambda s: s.start)
            for i, later in enumerate(ordered):
                for earlier in ordered[:i]:
                    if earlier.end is None or earlier.end > later.start:
                        found.setdefault(name, []).append((earlier.start, earlier.end, later.start))
        return found

    def resubscribed(self, names: set[str], fault_at: float) -> dict[str, tuple[float, float]]:
        """Per observer of ``names``: (its first subscribe after ``fault_at`` less the close of
        the subscription it had at ``fault_at``, that subscribe less ``fault_at``)."""
        out: dict[str, tuple[float, float]] = {}
        for name in names:
            before = [s for s in self.subs[name] if s.start < fault_at]
            after = [s for s in self.subs[name] if s.start >= fault_at]
            assert before, f"{name} had no subscription at the fault"
            assert after, f"{name} never subscribed again after the fault"
            closed = before[-1].end
            assert closed is not None, f"{name}: its subscription at the fault never closed"
            out[name] = (after[0].start - closed, after[0].start - fault_at)
        return out

    def count(self) -> int:
        return sum(len(subs) for subs in self.subs.values())


def _describe(
    overlaps: dict[str, list[tuple[float, float | None, float]]], at: dict[str, float]
) -> str:
    """The overlaps, in seconds since the test started, with the faults' times."""
    t0 = at["started"]
    faults = ", ".join(f"{k} at {v - t0:.3f}" for k, v in at.items() if k != "started")
    lines = [
        f"{name}: live from {a - t0:.3f} to "
        f"{'(still open)' if b is None else f'{b - t0:.3f}'}, another from {c - t0:.3f}"
        for name, found in sorted(overlaps.items())
        for a, b, c in found
    ]
    return (
        f"two live subscriptions of one observer at once, {len(overlaps)} observers "
        f"({faults}):\n" + "\n".join(lines[:10])
    )


async def _now(value: bool) -> bool:
    return value


async def _create(cluster: Cluster, port: int, count: int = OBSERVERS) -> dict[str, uuid.UUID]:
    """The observers, by name: each subscribes on its own path with a frame naming itself."""
    names = [f"ws-{i:03d}" for i in range(count)]
    ids: dict[str, uuid.UUID] = {}
    async with cluster.api() as api:

        async def create(name: str) -> None:
            params: dict[str, Any] = {
                "url": f"ws://127.0.0.1:{port}/feed/{name}",
                "subscribe": [subscribe_frame(name)],
                "reconnect_base": 0.1,
                "reconnect_max": 1.0,
            }
            body = {"name": name, "kind": "websocket", "params": params}
            r: httpx.Response = await api.post("/observers", json=body)
            assert r.status_code == 201, r.text
            ids[name] = uuid.UUID(r.json()["id"])

        for i in range(0, len(names), 20):
            await asyncio.gather(*(create(n) for n in names[i : i + 20]))
    return ids


async def _holders(cluster: Cluster, procs: list[Proc]) -> dict[int, set[str]]:
    """Per service process (its pid), the names of the observers it holds in the store."""
    by_id = {await cluster.service_id(p): p.pid for p in procs}
    rows = await cluster.q("SELECT name, service_id FROM observers WHERE status = 'processing'")
    out: dict[int, set[str]] = {p.pid: set() for p in procs}
    for r in rows:
        if r["service_id"] in by_id:
            out[by_id[r["service_id"]]].add(r["name"])
    return out


async def test_websocket_subscriptions_never_overlap_across_a_crash_and_a_freeze(
    cluster: Cluster,
) -> None:
    started = time.monotonic()
    port = free_port()
    server = FeedServer(port)
    await server.start()
    try:
        allow = f"127.0.0.1:{port}"
        await cluster.start_manager(lease_ttl=LEASE_TTL, http_poll_allow=allow)
        procs = [
            await cluster.start_service(
                name, worker_count=WORKERS, lease_ttl=LEASE_TTL, http_poll_allow=allow
            )
            for name in ("a", "b", "c")
        ]
        ids = await _create(cluster, port)
        names = sorted(ids)
        await wait_for(
            lambda: _now(server.one_each(names)),
            timeout=90,
            what=f"{OBSERVERS} subscriptions, one each",
            every=0.2,
        )
        print(f"\nsubscribed: {len(names)} in {time.monotonic() - started:.1f} s", flush=True)

        # ----------------------------------------------------------------- a crash
        held = await _holders(cluster, procs)
        print(f"placement: {sorted(len(v) for v in held.values())}", flush=True)
        victim = max(procs, key=lambda p: len(held[p.pid]))
        on_victim = held[victim.pid]
        assert on_victim, f"no observer on the service to kill: {held}"
        killed_at = time.monotonic()
        victim.signal(signal.SIGKILL)
        await wait_for(
            lambda: _now(server.subscribed_since(on_victim, killed_at)),
            timeout=KILL_BOUND + 20,
            what=f"the {len(on_victim)} observers of the killed service subscribed again",
            every=0.1,
        )
        overlaps = server.overlaps()
        assert not overlaps, _describe(overlaps, {"started": started, "killed": killed_at})
        after_kill = server.resubscribed(on_victim, killed_at)

        # ----------------------------------------------------------------- a freeze
        survivors = [p for p in procs if p is not victim]
        await wait_for(
            lambda: _now(server.one_each(names)), timeout=20, what="one subscription each"
        )
        held = await _holders(cluster, survivors)
        frozen = max(survivors, key=lambda p: len(held[p.pid]))
        on_frozen = held[frozen.pid]
        assert on_frozen, f"no observer on the service to freeze: {held}"
        async with cluster.frozen(frozen):
            frozen_at = time.monotonic()
            await wait_for(
                lambda: _now(server.subscribed_since(on_frozen, frozen_at)),
                timeout=FREEZE_BOUND + 20,
                what=f"the {len(on_frozen)} observers of the frozen service subscribed again",
                every=0.1,
            )
        woken_at = time.monotonic()

        # ------------------------------------------------------- settled, then judged
        async def settled() -> bool:
            return server.one_each(names) and time.monotonic() - server.changed_at >= 1.0

        settling: TimeoutError | None = None
        try:
            await wait_for(settled, timeout=30, what="one subscription each, for a second")
        except TimeoutError as exc:
            settling = exc  # judged after the overlaps, which it would come from
        at = {"started": started, "killed": killed_at, "frozen": frozen_at, "woken": woken_at}
        overlaps = server.overlaps()
        assert not overlaps, _describe(overlaps, at)
        assert settling is None, f"{settling}; not one each: {server.not_one_each(names)}"
        # The store agrees: every observer processing on the one service neither killed nor
        # frozen (a websocket observer never checkpoints state: no ``wait_all_running``).
        (last,) = [p for p in survivors if p is not frozen]
        last_id = await cluster.service_id(last)

        async def held_by_the_last() -> bool:
            n = await cluster.q(
                "SELECT count(*) FROM observers WHERE id = ANY($1) AND status = 'processing' "
                "AND service_id = $2",
                list(ids.values()),
                last_id,
                one=True,
            )
            return bool(n == OBSERVERS)

        await wait_for(held_by_the_last, timeout=30, what="every observer on the last service")
        after_freeze = server.resubscribed(on_frozen, frozen_at)

        kill_gap = max(g for g, _ in after_kill.values())
        kill_since = max(s for _, s in after_kill.values())
        freeze_gap = max(g for g, _ in after_freeze.values())
        freeze_since = max(s for _, s in after_freeze.values())
        # How long the server took to drop a frozen client (the SIGSTOP to its close).
        detected = max(s - g for g, s in after_freeze.values())
        # By how much the successors missed an overlap, at the least.
        margin = min(g for g, _ in after_freeze.values())
        print(
            f"subscriptions: {server.count()} "
            f"({OBSERVERS} + {len(on_victim)} moved by the crash + {len(on_frozen)} moved by "
            f"the freeze); strays: {len(server.strays)}\n"
            f"after the SIGKILL: max gap (close to subscribe) {kill_gap:.3f} s, "
            f"max since the kill {kill_since:.3f} s (bound {KILL_BOUND} s)\n"
            f"after the SIGSTOP: max gap (close to subscribe) {freeze_gap:.3f} s "
            f"(min {margin:.3f} s), "
            f"max since the freeze {freeze_since:.3f} s (bound {FREEZE_BOUND} s); "
            f"frozen clients dropped by the server within {detected:.3f} s; "
            f"woken {woken_at - frozen_at:.1f} s after the freeze\n"
            f"runtime {time.monotonic() - started:.1f} s",
            flush=True,
        )
        late_kill = {n: round(s, 3) for n, (_, s) in after_kill.items() if s > KILL_BOUND}
        assert not late_kill, f"subscribed again later than {KILL_BOUND} s after the crash"
        late_freeze = {n: round(s, 3) for n, (_, s) in after_freeze.items() if s > FREEZE_BOUND}
        assert not late_freeze, f"subscribed again later than {FREEZE_BOUND} s after the freeze"
        assert all(g > 0 for g, _ in after_freeze.values())
        assert not server.strays, f"unexpected connections or frames: {server.strays[:10]}"
    finally:
        await server.stop()


async def test_a_copy_fenced_while_frozen_drops_its_subscription_as_it_wakes(
    cluster: Cluster,
) -> None:
    """A server that never pings keeps a frozen client's subscription open: while the process
    is stopped nothing can close it. Once it wakes, its copies are abandoned (their code never
    runs again) and the sockets they registered are aborted at once: without that, the
    websocket library's own tasks kept each connection open, answering pings, beside the copy
    that took over, for as long as the process lived."""
    port = free_port()
    server = FeedServer(port, ping_interval=None)
    await server.start()
    try:
        allow = f"127.0.0.1:{port}"
        await cluster.start_manager(lease_ttl=LEASE_TTL, http_poll_allow=allow)
        a = await cluster.start_service(
            "a", worker_count=20, lease_ttl=LEASE_TTL, http_poll_allow=allow
        )
        ids = await _create(cluster, port, count=20)
        names = sorted(ids)
        await wait_for(
            lambda: _now(server.one_each(names)), timeout=60, what="20 subscriptions, one each"
        )
        b = await cluster.start_service(
            "b", worker_count=20, lease_ttl=LEASE_TTL, http_poll_allow=allow
        )
        on_a = (await _holders(cluster, [a, b]))[a.pid]
        assert on_a
        async with cluster.frozen(a):
            frozen_at = time.monotonic()
            await wait_for(
                lambda: _now(server.subscribed_since(on_a, frozen_at)),
                timeout=FREEZE_BOUND + 20,
                what="the frozen service's observers subscribed on the other",
                every=0.1,
            )
        woken_at = time.monotonic()
        await wait_for(
            lambda: _now(server.one_each(names)),
            timeout=15,
            what="the woken service's stale subscriptions closed",
            every=0.1,
        )
        closed = [s.end for n in on_a for s in server.subs[n] if s.start < frozen_at]
        assert all(t is not None for t in closed)
        late = max(t - woken_at for t in closed if t is not None)
        print(f"\nstale subscriptions closed within {late:.3f} s of waking", flush=True)
        assert late < 5.0, f"a stale subscription stayed open {late:.1f} s after waking"
    finally:
        await server.stop()
