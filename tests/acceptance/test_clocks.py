"""Clocks that lie: a service paused with every local clock frozen (a hypervisor's stun, a live
migration), and one whose clocks step back. ``libfaketime`` (Debian's ``faketime``, installed by
``scripts/test``) shifts every clock of the service it is preloaded into, from a file this test
writes.

Judged from the recorders' own ticks, stamped as this test reads them (the shifted service
stamps its ticks with its shifted clock): once the successor ran an observer, the stale copy
may run on for at most one renewal period and its round trip (``RESIDUAL``), the residual the
failure argument names; and no write of the stale copy lands (its checkpoint is fenced).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, Proc

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

pytestmark = [
    pytest.mark.skipif(
        not LIBFAKETIME.exists(), reason="libfaketime is not installed (scripts/test installs it)"
    ),
    pytest.mark.processes,
]


@dataclass
class Arrivals:
    """Each tick line as this process saw it appear: (real time, observer, epoch, pid)."""

    seen: list[tuple[float, str, int, int]] = field(default_factory=list)

    def first(self, observer: str, pid: int) -> float | None:
        return min((t for t, o, _, p in self.seen if o == observer and p == pid), default=None)

    def last(self, observer: str, pid: int) -> float | None:
        return max((t for t, o, _, p in self.seen if o == observer and p == pid), default=None)


@contextlib.asynccontextmanager
async def arrivals(directory: Path, every: float = 0.02) -> AsyncIterator[Arrivals]:
    """Read the tick files as they grow, stamping each new line with this process's clock."""
    out = Arrivals()
    offsets: dict[Path, int] = {}

    def read() -> None:
        now = time.time()
        for path in sorted(directory.glob("*.jsonl")):
            with path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                tick = json.loads(line)
                out.seen.append((now, tick["o"], int(tick["e"]), int(tick["p"])))

    async def watch() -> None:
        while True:
            await asyncio.to_thread(read)
            await asyncio.sleep(every)

    task = asyncio.create_task(watch())
    try:
        yield out
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        read()


def _shift(rc: Path, seconds: float) -> None:
    """Every clock of the service preloaded with ``rc`` reads ``seconds`` off from now on."""
    rc.write_text(f"{seconds:+.3f}s\n")


async def _shifted_service(cluster: Cluster, name: str, rc: Path) -> Proc:
    """A service whose every clock reads as ``rc`` says (unshifted at first)."""
    _shift(rc, 0.0)
    shifted = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(rc),
        "FAKETIME_NO_CACHE": "1",
    }
    cluster.env.update(shifted)
    try:
        return await cluster.start_service(name, worker_count=20)
    finally:
        for key in shifted:
            cluster.env.pop(key, None)


def _residual(cluster: Cluster) -> float:
    """One renewal period (a fifth of the lease) and a round trip, with room for a busy host."""
    return cluster.lease_ttl / 5 + 0.5


async def _checkpoints_fenced(cluster: Cluster, ids: list[uuid.UUID], pid: int) -> None:
    """Every observer's row names its successor's epoch: nothing the stale copy wrote landed
    over it."""
    rows = await cluster.q(
        "SELECT o.id, o.epoch, s.pid FROM observers o JOIN services s ON s.id = o.service_id "
        "WHERE o.id = ANY($1)",
        ids,
    )
    assert len(rows) == len(ids)
    assert all(r["pid"] != pid for r in rows), "a row went back to the stale service"


def _stale_for(seen: Arrivals, ids: list[uuid.UUID], stale: int, after: set[int]) -> float:
    """The longest a stale copy (process ``stale``) ticked after a successor's first tick."""
    worst = 0.0
    for oid in map(str, ids):
        firsts = [t for p in after if (t := seen.first(oid, p)) is not None]
        last = seen.last(oid, stale)
        if firsts and last is not None:
            worst = max(worst, last - min(firsts))
    return worst


@contextlib.asynccontextmanager
async def line_server(every: float = 0.05) -> AsyncIterator[int]:
    """A TCP server on a free port that sends each client a line every ``every`` seconds (a
    feed's messages, on the clock of this process)."""

    async def feed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"tick\n")
                await writer.drain()
                await asyncio.sleep(every)

    server = await asyncio.start_server(feed, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def _pulses(cluster: Cluster, port: int, n: int = 10) -> list[uuid.UUID]:
    """``n`` observers that tick on each line of the server at ``port`` (no timer of theirs)."""
    ids = []
    for i in range(n):
        body = await cluster.create(
            f"pulse-{i}", "pulse", dir=str(cluster.tick_dir), port=port, checkpoint_every=10**6
        )
        ids.append(uuid.UUID(body["id"]))
    return ids


async def test_a_service_paused_with_its_clocks_frozen_runs_no_longer_than_a_renewal(
    cluster: Cluster,
) -> None:
    """Paused past its lease, and woken with its clocks reading as if no time had passed: its
    deadline looks valid, and the messages that came meanwhile wait to be read. Its copies may
    run from the resume to the next renewal's answer (the residual), no longer; and nothing
    they write lands."""
    rc = cluster.workdir / "faketime-a.rc"
    await cluster.start_manager()
    a = await _shifted_service(cluster, "a", rc)
    async with line_server() as port:
        ids = await _pulses(cluster, port)
        await cluster.wait_all_running(ids, timeout=15)
        b = await cluster.start_service("b", worker_count=20)
        b_id = await cluster.service_id(b)
        async with arrivals(cluster.tick_dir) as seen:
            paused = time.time()
            a.signal(signal.SIGSTOP)
            try:
                await cluster.wait_all_running(ids, timeout=20, on={b_id}, fresh_after=paused)
                await asyncio.sleep(0.5)  # b's copies run a while
            finally:
                # Its clocks go on from where they stopped: no time passed, as far as it knows.
                _shift(rc, -(time.time() - paused + 0.05))
                resumed = time.time()
                a.signal(signal.SIGCONT)
            await a.wait_log("lease lost", timeout=10)
            await asyncio.sleep(1.0)
    after = max((t - resumed for t, _, _, p in seen.seen if p == a.pid and t > resumed), default=0)
    assert after <= _residual(cluster), f"the stale copies ran {after:.2f}s after the resume"
    await _checkpoints_fenced(cluster, ids, a.pid)


async def test_a_service_whose_clocks_step_back_runs_one_copy_and_keeps_running(
    cluster: Cluster,
) -> None:
    """Every clock_gettime clock of the service steps back 30 s while the messages its
    observers receive keep coming. A deadline measured on those clocks would look valid for
    30 s more while renewals wait those 30 s out: the lease ends in the database, another
    service takes the observers, and the stale copies run on beside them. Time read where the
    step cannot reach keeps the renewals on schedule: one copy of each, ticking throughout."""
    rc = cluster.workdir / "faketime-a.rc"
    await cluster.start_manager()
    a = await _shifted_service(cluster, "a", rc)
    async with line_server() as port:
        ids = await _pulses(cluster, port)
        await cluster.wait_all_running(ids, timeout=15)
        b = await cluster.start_service("b", worker_count=20)
        async with arrivals(cluster.tick_dir) as seen:
            stepped = time.time()
            _shift(rc, -30.0)
            await asyncio.sleep(3 * cluster.lease_ttl + 2.0)  # past the lease, had it lapsed
            end = time.time()
    stale = _stale_for(seen, ids, a.pid, {b.pid})
    assert stale <= _residual(cluster), f"the stale copies ran {stale:.2f}s beside b's"
    for oid in map(str, ids):
        times = sorted(t for t, o, _, _ in seen.seen if o == oid and t > stepped)
        gaps = [b - a for a, b in zip([stepped, *times], [*times, end], strict=True)]
        assert max(gaps) <= cluster.lease_ttl + 1.0, f"{oid} did not run for {max(gaps):.2f}s"
