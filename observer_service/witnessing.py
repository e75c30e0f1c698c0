"""Verify mode's memory witness: how much memory each kind's own code keeps.

``tracemalloc`` traces every allocation with its call stack (``FRAMES`` deep) from the start of
the process (``main`` starts it when ``ORCH_WITNESS_DIR`` is set, unless
``ORCH_WITNESS_MEMORY=false``). Every ``EVERY`` seconds the bytes still held by allocations made
inside a kind's own source (the lines of its function or class), or by anything that code
called, are written per kind with the number of its copies here: ``orch verify`` turns the
series into growth per observer. The sample is taken and attributed in a thread, so the event
loop (lease renewals, other copies) does not wait for it, though it shares the interpreter.

Tracing is costly: every allocation of the process records its stack, so Python code runs
several times slower while it is on, the sample's own attribution included. The attribution
therefore walks each distinct stack once (``Snapshot.statistics``), not every allocation: a
sample of 600,000 allocations took 80 s of a loaded core one by one, 13 s by stack. A long run
whose timing is judged (the soak, which measures each process's memory from outside) turns
tracing off.

Memory a kind keeps through code that is not on the stack of the allocation (a library's own
cache filled later, from its own thread or callback) is not attributed to it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from observer_service.runner import Runner
from orch_contracts.kinds import KindSpec
from orch_contracts.witness import Witness

log = logging.getLogger(__name__)

#: Stack frames kept per allocation: enough to reach the kind's own frame from a library call.
FRAMES = 8
#: Seconds between two samples.
EVERY = 5.0

#: file -> [(first line, last line, kind)]
Sources = dict[str, list[tuple[int, int, str]]]


def start_tracing() -> None:
    tracemalloc.start(FRAMES)


def source_of(spec: KindSpec) -> tuple[str, int, int] | None:
    """The file and lines of the function or class that defines the kind (its ``origin``)."""
    module_name, _, qualname = spec.origin.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        obj = inspect.unwrap(obj)  # type: ignore[arg-type]
        path = inspect.getsourcefile(obj)  # type: ignore[arg-type]
        lines, first = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    except (ImportError, AttributeError, TypeError, OSError):
        return None
    return (path, first, first + len(lines) - 1) if path else None


def attribute(snapshot: tracemalloc.Snapshot, sources: Sources) -> Counter[str]:
    """Bytes per kind: each allocation goes to the innermost kind's code on its stack (each
    distinct stack is looked at once, with the bytes of all its allocations)."""
    held: Counter[str] = Counter()
    for stat in snapshot.statistics("traceback"):
        for frame in stat.traceback:
            spans = sources.get(frame.filename)
            if spans is None:
                continue
            kind = next((k for a, b, k in spans if a <= frame.lineno <= b), None)
            if kind is not None:
                held[kind] += stat.size
                break
    return held


class MemoryWitness:
    def __init__(
        self,
        witness: Witness,
        kinds: dict[str, KindSpec],
        runners: Callable[[], Iterable[Runner]],
    ) -> None:
        self.witness = witness
        self.runners = runners
        self.sources: Sources = defaultdict(list)
        for name, spec in kinds.items():
            found = source_of(spec)
            if found is not None:
                path, first, last = found
                self.sources[path].append((first, last, name))

    async def run(self) -> None:
        if not tracemalloc.is_tracing():
            log.warning("memory is not traced in this process: no memory witness")
            return
        while True:
            await asyncio.sleep(EVERY)
            copies = Counter(r.ctx.kind for r in self.runners())
            if not copies:
                continue
            try:
                held = await asyncio.to_thread(self._sample)
            except Exception:  # the witness must never stop the service
                log.exception("memory sample failed")
                continue
            for kind, n in copies.items():
                self.witness.memory(kind, held.get(kind, 0), n)

    def _sample(self) -> Counter[str]:
        return attribute(tracemalloc.take_snapshot(), self.sources)
