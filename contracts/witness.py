"""The witness: what kind code really did, written where no fence can refuse it.

A stale copy's database writes are refused, so the orchestrator's tables cannot show that two
copies ran at once. The witness can. In verify mode (``ORCH_WITNESS_DIR`` set, as ``orch verify``
does) every service process appends to ``{dir}/{pid}.jsonl`` one JSON object per line, each
written by a single ``write`` on an ``O_APPEND`` descriptor: a line survives a SIGKILL, and lines
written from a kind's own threads never interleave.

Records (``r``), each with the observer ``o``, the copy's epoch ``e``, the service ``s``, the
process ``p`` and the wall time ``t``:

- ``run``: the copy's coroutine resumed (written before it does; at most one line per copy per
  ``RESOLUTION`` seconds, so a copy's span is known to that resolution);
- ``fx``: the kind said a side effect follows (``ctx.witness(event)``, any thread), event ``x``;
- ``stop``: the service asked the copy to stop, reason ``x``;
- ``end``: the copy's task ended;
- ``hung``: a graceful stop gave up waiting for the copy (the process exits with it running);
- on ``end``, ``w``: the seconds the copy's stop waited on the orchestrator's own commit of its
  checkpoint (a stop never cuts that write short), which are not the kind's; on ``hung``, the
  seconds of the wait under way when the stop gave up (none: the kind's code held it);
- ``stall``: one step of the copy held the event loop for ``d`` seconds (from ``STALL``);
- ``mem``: bytes still allocated by kind ``k``'s code in this process (``b``) over its ``n``
  copies here (no observer).

The recorder kind's tick log (``tick_line``) is the same idea written by a kind itself, one line
per tick; the benchmark's broker floor writes it too.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

#: Seconds: a copy's resumptions closer than this to its last written one are not written.
RESOLUTION = 0.01
#: Seconds: a step of kind code at least this long is written as a stall.
STALL = 0.1
#: Logged once by a process whose witness could not be written.
BROKEN = "the witness could not be written"

log = logging.getLogger(__name__)


class Witness:
    """The per-process writer."""

    def __init__(self, directory: str | Path, service_id: uuid.UUID) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self._fd = os.open(path / f"{self.pid}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._service = str(service_id)
        self._last_run: dict[tuple[uuid.UUID, int], float] = {}
        #: Why a write failed, once one did: the record is incomplete from then on.
        self.broken: str | None = None

    def _write(self, r: str, observer: uuid.UUID | None, epoch: int, **more: Any) -> None:
        """One line; a write that fails (a full disk) never reaches the caller: the witness is
        marked broken and says so once in the log, which ``orch verify`` reads (``BROKEN``)."""
        line: dict[str, Any] = {"r": r, "o": str(observer) if observer else None, "e": epoch}
        line.update(s=self._service, p=self.pid, t=time.time(), **more)
        data = orjson.dumps(line) + b"\n"
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError("short write")
        except OSError as exc:
            if self.broken is None:
                self.broken = str(exc)
                log.error("%s: %s", BROKEN, exc)

    def ran(self, observer: uuid.UUID, epoch: int) -> None:
        """The copy's coroutine is about to resume (called on the event loop)."""
        key = (observer, epoch)
        now = time.monotonic()
        if now - self._last_run.get(key, -RESOLUTION) >= RESOLUTION:
            self._last_run[key] = now
            self._write("run", observer, epoch)

    def effect(self, observer: uuid.UUID, epoch: int, event: str) -> None:
        """A side effect follows (any thread: one ``write`` per line keeps lines whole)."""
        self._write("fx", observer, epoch, x=str(event)[:200])

    def stop(self, observer: uuid.UUID, epoch: int, why: str) -> None:
        self._write("stop", observer, epoch, x=why)

    def end(self, observer: uuid.UUID, epoch: int, waited: float = 0.0) -> None:
        """The copy's task ended; its stop waited ``waited`` seconds on its commit write."""
        self._last_run.pop((observer, epoch), None)
        self._write("end", observer, epoch, **_waited(waited))

    def hung(self, observer: uuid.UUID, epoch: int, waited: float = 0.0) -> None:
        """A graceful stop gave up on the copy, which has waited ``waited`` seconds on its
        commit write (0: it is not in one)."""
        self._write("hung", observer, epoch, **_waited(waited))

    def stall(self, observer: uuid.UUID, epoch: int, seconds: float) -> None:
        self._write("stall", observer, epoch, d=round(seconds, 4))

    def memory(self, kind: str, size: int, copies: int) -> None:
        self._write("mem", None, 0, k=kind, b=size, n=copies)

    def close(self) -> None:
        os.close(self._fd)


def _waited(seconds: float) -> dict[str, float]:
    return {"w": round(seconds, 3)} if seconds > 0 else {}


@dataclass(frozen=True)
class Record:
    r: str
    observer: str | None
    epoch: int
    service: str
    pid: int
    at: float
    detail: dict[str, Any]

    @property
    def copy(self) -> tuple[str, int, int]:
        """Which copy: observer, epoch, process."""
        return (self.observer or "", self.epoch, self.pid)


class Reader:
    """Reads the witness files under ``directory`` as they grow: each call to ``read`` parses
    only the lines completed since the last one (a line cut short by a SIGKILL is skipped)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.records: list[Record] = []
        self._offsets: dict[Path, int] = {}

    def read(self) -> list[Record]:
        """Every record so far, oldest first."""
        added = False
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            whole = data.rfind(b"\n") + 1
            self._offsets[path] = offset + whole
            for line in data[:whole].splitlines():
                try:
                    d = orjson.loads(line)
                    r, o, e, s, p, t = (d.pop(key) for key in ("r", "o", "e", "s", "p", "t"))
                    self.records.append(Record(r, o, e, s, p, t, d))
                    added = True
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
        if added:
            self.records.sort(key=lambda rec: rec.at)
        return self.records


def read(directory: str | Path) -> list[Record]:
    """Every witness record under ``directory``, oldest first."""
    return Reader(directory).read()


#: Seconds after a SIGCONT within which the step that was cut by the SIGSTOP completes.
THAW = 0.5

Item = TypeVar("Item")


def across_freeze(
    items: Iterable[Item],
    *,
    pid: Callable[[Item], int],
    copy: Callable[[Item], Hashable],
    at: Callable[[Item], float],
    paused: dict[int, list[tuple[float, float]]],
) -> list[Item]:
    """The items (witness records, ticks) that are a copy's *step across a freeze*: the last
    item of its copy, stamped by a process just after it was resumed from a SIGSTOP.

    No check can cover the synchronous code between a copy's last lease check and what it does
    next (``guard.py``): a process stopped right there finishes that one step when it wakes,
    whoever took its observers meanwhile. So each freeze may leave one such item, from the one
    copy that was running at the instant of the SIGSTOP, and no more: a freeze after which two
    copies of the process stepped, or one copy stepped twice, leaves none out. What a fenced
    write, refused when its epoch is stale, is what makes such a step harmless."""
    items = list(items)
    last: dict[Hashable, Item] = {}
    for item in items:
        key = copy(item)
        if key not in last or at(item) >= at(last[key]):
            last[key] = item
    after: dict[tuple[int, float], list[Item]] = {}
    for item in items:
        for stopped, resumed in paused.get(pid(item), []):
            if stopped < at(item) <= resumed + THAW:
                after.setdefault((pid(item), stopped), []).append(item)
    found = []
    for stepped in after.values():
        if len(stepped) == 1 and last[copy(stepped[0])] is stepped[0]:
            found.append(stepped[0])
    return found


def overlapping(
    spans: Iterable[Item],
    *,
    observer: Callable[[Item], Hashable],
    first: Callable[[Item], float],
    last: Callable[[Item], float],
) -> list[tuple[Item, Item, float]]:
    """The one judge of "two copies at once", for the benchmark's tick logs, ``orch verify``'s
    witness and the tests: every pair of one observer's copies whose spans (from ``first`` to
    ``last``, what each was seen doing) intersect, and for how many seconds (a single instant
    inside another copy's span counts, as 0 s). Pairs in the order of their second copy's
    start."""
    by_observer: dict[Hashable, list[Item]] = {}
    for span in spans:
        by_observer.setdefault(observer(span), []).append(span)
    found = []
    for copies in by_observer.values():
        copies.sort(key=first)
        for i, a in enumerate(copies):
            for b in copies[i + 1 :]:
                if first(b) > last(a):
                    break
                found.append((a, b, min(last(a), last(b)) - first(b)))
    return found


def tick_line(observer: object, epoch: int, service: object, count: int) -> str:
    """One tick as a JSON line: observer, epoch, service, process, wall time, count. Written
    cheaply: at a 20 ms tick a thousand recorders write fifty thousand a second."""
    return (
        f'{{"o":"{observer}","e":{epoch},"s":"{service}","p":{os.getpid()},'
        f'"t":{time.time()!r},"n":{count}}}\n'
    )
