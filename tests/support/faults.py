"""What fault tests share: judging tick logs, proxies in front of a server, broker counters."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

from orch_bench.ticklog import overlap_seconds, read_ticks
from orch_contracts.witness import across_freeze
from orch_verify.campaign import LEASE_BACKEND, rabbitmqctl
from orch_verify.proxy import via

__all__ = ["LEASE_BACKEND", "rabbitmqctl", "via"]


def assert_no_overlap(
    tick_dir: Path, paused: dict[int, list[tuple[float, float]]] | None = None
) -> None:
    """No two copies of an observer ticked in overlapping time. With ``paused`` (per process,
    its SIGSTOP windows), a tick that is a step across a freeze (``witness.across_freeze``: at
    most one per freeze) is left out, and printed."""
    ticks = read_ticks(tick_dir)
    assert ticks, "no ticks recorded"
    if paused:
        late = across_freeze(
            ticks,
            pid=lambda t: t.pid,
            copy=lambda t: (t.observer, t.copy),
            at=lambda t: t.at,
            paused=paused,
        )
        for t in late:
            print(f"tick across a freeze: {t}", flush=True)
        ticks = [t for t in ticks if t not in late]
    overlap = overlap_seconds(ticks)
    assert overlap == {}, f"two copies of an observer ran at the same time: {overlap}"


def ticks_of(tick_dir: Path, pid: int, after: float) -> int:
    """Ticks written by process ``pid`` after ``after`` (epoch seconds)."""
    return sum(1 for t in read_ticks(tick_dir) if t.pid == pid and t.at > after)


@contextlib.contextmanager
def broker_env(**values: int) -> Iterator[None]:
    """Set the broker's ``rabbit`` application environment for a while; put back what was
    there (or unset it) whatever happens."""
    before = {k: rabbitmqctl("eval", f"application:get_env(rabbit, {k}).").strip() for k in values}
    try:
        for key, value in values.items():
            rabbitmqctl("eval", f"application:set_env(rabbit, {key}, {value}).")
        yield
    finally:
        for key, was in before.items():
            if was.startswith("{ok,"):
                old = was.removeprefix("{ok,").removesuffix("}")
                rabbitmqctl("eval", f"application:set_env(rabbit, {key}, {old}).")
            else:
                rabbitmqctl("eval", f"application:unset_env(rabbit, {key}).")


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """A memory alarm on the shared broker (publishers blocked) for a while; the watermark put
    back exactly as it was, whatever happens."""
    was = rabbitmqctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip()
    try:
        rabbitmqctl("set_vm_memory_high_watermark", "0.0000001")
        yield
    finally:
        rabbitmqctl("eval", f"vm_memory_monitor:set_vm_memory_high_watermark({was}).")


@contextlib.contextmanager
def disk_alarm() -> Iterator[None]:
    """A disk alarm on the shared broker (publishers blocked): a free-disk limit above what the
    disk has, put back exactly as it was, whatever happens."""
    was = rabbitmqctl("eval", "rabbit_disk_monitor:get_disk_free_limit().").strip()
    try:
        rabbitmqctl("set_disk_free_limit", "1000000GB")
        yield
    finally:
        rabbitmqctl("eval", f"rabbit_disk_monitor:set_disk_free_limit({was}).")


def queue_counts(prefix: str) -> tuple[int, int]:
    """(ready, unacked) of the work queue, from the broker itself."""
    out = rabbitmqctl("-q", "list_queues", "name", "messages_ready", "messages_unacknowledged")
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == f"{prefix}.work":
            return int(parts[1]), int(parts[2])
    raise AssertionError(f"no work queue for {prefix} in {out!r}")


def service_uuid(value: object) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
