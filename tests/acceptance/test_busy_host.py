"""A service on a host whose CPUs are busy: slow, not stalled.

A step of kind code that blocks the event loop marks its service stalled (``stalls.py``): no taker
then treats the service as gone before its lease expires, and the leader places no work on it.
On a busy host every step of every process waits for a CPU now and then, and that wait is not the
kind's doing. Counted, it marked every service of a loaded test run stalled: crash takeover fell
back from a fraction of a second to the lease TTL, and a freeze's observers waited for the
broker's heartbeat instead of the lease.

Here one service's threads share a CPU with busy processes, so that a kind computing for
``BURN`` seconds of CPU per step takes several times ``MARK_AFTER`` on the wall clock (its own
checkpoints say so). The service must never be marked stalled, and no copy may end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from observer_service.stalls import MARK_AFTER
from tests.support.cluster import Cluster, wait_for

#: It needs the machine, or the shared servers, to itself.
pytestmark = pytest.mark.alone

#: CPU seconds of each step: well under MARK_AFTER, so only waiting for the CPU makes it long.
BURN = 0.02
#: Busy processes on the service's CPU, enough to make a step of BURN take several MARK_AFTER.
SPINNERS = 12
OBSERVERS = 4
#: Steps to watch each observer take while the service is starved.
STEPS = 15


def _pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` on ``cpu`` (threads made later inherit it from their maker)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {cpu})


@contextlib.contextmanager
def _spinners(cpu: int, n: int) -> Iterator[None]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            procs.append(p)
            os.sched_setaffinity(p.pid, {cpu})
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs (one to starve the service on, one for the rest)",
)
@pytest.mark.processes
async def test_a_service_starved_of_cpu_is_not_marked_stalled(cluster: Cluster) -> None:
    await cluster.start_manager()
    svc = await cluster.start_service("a", worker_count=10)
    ids = []
    for i in range(OBSERVERS):
        body = await cluster.create(f"burn-{i}", "burner", burn=BURN, every=0.05)
        ids.append(uuid.UUID(body["id"]))
    await cluster.wait_all_running(ids, timeout=20)
    service_id = await cluster.service_id(svc)

    async def progress() -> dict[uuid.UUID, tuple[int, float, int]]:
        """Each observer's steps, longest step (from its checkpoints) and epoch."""
        rows = await cluster.q(
            "SELECT id, coalesce((checkpoint->>'steps')::int, 0) AS steps, "
            "coalesce((checkpoint->>'longest')::float8, 0) AS longest, epoch "
            "FROM observers WHERE id = ANY($1)",
            ids,
        )
        return {r["id"]: (r["steps"], r["longest"], r["epoch"]) for r in rows}

    cpu = max(os.sched_getaffinity(0))
    marks: list[object] = []  # every stalled_since seen
    with _spinners(cpu, SPINNERS):
        _pin(svc.pid, cpu)
        before = await progress()
        starved_at = time.monotonic()

        async def enough_steps() -> bool:
            since = await cluster.q(
                "SELECT stalled_since FROM services WHERE id = $1", service_id, one=True
            )
            if since is not None:
                marks.append(since)
            now = await progress()
            return all(now[i][0] - before[i][0] >= STEPS for i in ids)

        await wait_for(enough_steps, timeout=120, what=f"{STEPS} steps of each observer", every=0.1)
        elapsed = time.monotonic() - starved_at
    after = await progress()
    longest = max(after[i][1] for i in ids)
    print(
        f"\nstarved: {STEPS}+ steps each in {elapsed:.1f} s; longest step {longest:.3f} s "
        f"for {BURN} s of CPU; marks seen: {len(marks)}",
        flush=True,
    )
    assert longest > 2 * MARK_AFTER, (
        f"the starvation was too mild to judge: the longest step took {longest:.3f} s"
    )
    assert not marks, f"a service starved of CPU was marked stalled (at {marks[0]})"
    statuses = await cluster.q("SELECT status FROM observers WHERE id = ANY($1)", ids)
    assert {r["status"] for r in statuses} == {"processing"}, [dict(r) for r in statuses]
    assert all(after[i][2] == before[i][2] for i in ids), "a copy ended and was taken again"
    assert svc.alive
