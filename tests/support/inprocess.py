"""The in-process tier: a manager and services that run in the test's own event loop, against
the real PostgreSQL and RabbitMQ, built by the same code as the processes (``serving.serve``,
``main.assembled``) minus what belongs to a process (its signals, its log's stream, exiting).

A test that kills, freezes or cuts off nothing runs here: a start costs no interpreter and no
imports, and a stop no exit. A test that needs a process's own behaviour (a fault, an exit
code, its pid, its start-up) is marked ``processes`` and gets ``Cluster``'s real processes.
Asking an in-process component for what only a process has fails with that advice.

Each component writes its own log file, as a process does: its log lines are routed by the
context its task runs in (every task it creates inherits it)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import IO, Any

from observer_service import guard
from observer_service.main import assembled, run
from observer_service.settings import ServiceSettings
from orch.cluster import Logged, Proc, free_port
from orch_contracts import logs
from orch_contracts.kinds import load_kinds
from orch_manager.leader import new_holder_id
from orch_manager.serving import serve
from orch_manager.settings import ManagerSettings
from tests.support.cluster import Cluster, orch_env

ADVICE = "a test that needs real processes is marked @pytest.mark.processes"
#: Settings a process holds once for all it runs (the kinds it imported, what the kinds read
#: from its environment): one given to a single component needs a process of its own.
PROCESS_WIDE = frozenset({"ORCH_KIND_MODULES", "ORCH_HTTP_POLL_ALLOW", "ORCH_TEST_KIND_VERSION"})

#: The log file of the component whose task is running.
_LOG: contextvars.ContextVar[IO[str] | None] = contextvars.ContextVar("_LOG", default=None)


class NeedsProcess(AssertionError):
    """An in-process component was asked for what only a process has."""


class _Route(logging.Handler):
    """Writes a record to the log file of the component it came from, if any."""

    def emit(self, record: logging.LogRecord) -> None:
        out = _LOG.get()
        if out is not None:
            try:
                out.write(self.format(record) + "\n")
                out.flush()
            except (OSError, ValueError):  # closed with its component
                pass


def _route_logs() -> None:
    root = logging.getLogger()
    if not any(isinstance(h, _Route) for h in root.handlers):
        handler = _Route()
        handler.setFormatter(logs.formatter())
        root.addHandler(handler)
    logs.set_levels("INFO")


class Running(Logged):
    """A manager or a service running in this event loop; answers as ``Proc`` does where it
    can (``signal`` takes SIGTERM and SIGINT: a graceful stop)."""

    def __init__(self, name: str, log: Path, task: asyncio.Task[int], stop: Callable[[], None]):
        self.name = name
        self.log: Path | None = log
        self.task = task
        self.request_stop = stop
        self.port: int | None = None
        self.service_id: uuid.UUID | None = None

    @property
    def alive(self) -> bool:
        return not self.task.done()

    @property
    def pid(self) -> int:
        raise NeedsProcess(f"{self.name} runs in the test's process: {ADVICE}")

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.request_stop()
        elif sig != signal.SIGCONT:
            raise NeedsProcess(f"{signal.Signals(sig).name} to {self.name}: {ADVICE}")


class InProcessCluster(Cluster):
    """``Cluster`` whose managers and services run in the test's event loop."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.running: list[Running] = []
        _route_logs()

    def _settings(self, env: dict[str, Any]) -> dict[str, Any]:
        own = orch_env(env)
        if wide := sorted(PROCESS_WIDE & own.keys()):
            raise NeedsProcess(f"{', '.join(wide)} for one component: {ADVICE}")
        merged = {**self.env, **own}
        return {k.removeprefix("ORCH_").lower(): v for k, v in merged.items() if k[:5] == "ORCH_"}

    def _start(
        self, name: str, main: Coroutine[Any, Any, int], stop: Callable[[], None]
    ) -> Running:
        assert self.logdir is not None
        path = self.logdir / f"{name}-{len(self.running) + len(self.procs)}.log"
        out = path.open("w", encoding="utf-8")
        context = contextvars.copy_context()
        context.run(_LOG.set, out)

        async def logged() -> int:
            try:
                return await main
            except SystemExit as exc:  # uvicorn's, when its start fails
                logging.getLogger(__name__).error("%s exited with %s", name, exc.code)
                return int(exc.code or 0)
            except BaseException:
                logging.getLogger(__name__).exception("%s ended with an error", name)
                raise
            finally:
                out.close()

        task = asyncio.get_running_loop().create_task(logged(), name=name, context=context)
        running = Running(name, path, task, stop)
        self.running.append(running)
        return running

    async def start_manager(self, port: int | None = None, **env: Any) -> Running:  # type: ignore[override]
        port = port or free_port()
        settings = ManagerSettings(**{**self._settings(env), "port": port, "workers": 1})
        kinds = load_kinds(settings.kind_module_list)
        stop = asyncio.Event()
        main = serve(settings, kinds, new_holder_id(), stop=stop)
        manager = self._start("manager", main, stop.set)
        manager.port = port
        await self._wait_ready(manager, port)
        if self.api_port is None:
            self.api_port = port
        return manager

    async def start_service(  # type: ignore[override]
        self, name: str = "svc", worker_count: int = 10, **env: Any
    ) -> Running:
        if env.get("pool"):
            self.pools.add(str(env["pool"]))
        settings = ServiceSettings(
            **{**self._settings(env), "name": name, "worker_count": worker_count}
        )
        kinds = load_kinds(settings.kind_module_list)
        service_id = uuid.uuid4()
        stopping = asyncio.Event()

        async def main() -> int:
            abandoned = guard.abandoned()  # counted for the whole process
            async with assembled(settings, kinds, service_id=service_id) as service:
                stopper = asyncio.create_task(stopping.wait())
                stopper.add_done_callback(lambda _: service.request_stop())
                try:
                    code = await run(service)
                finally:
                    stopper.cancel()
                assert service.clean, f"{name} left copies running when it stopped"
                assert guard.abandoned() == abandoned, f"{name} abandoned copies"
                return code

        running = self._start(name, main(), stopping.set)
        running.service_id = service_id
        await self._wait_on_broker(running, service_id)
        return running

    async def service_id(self, proc: Proc | Running, *, wait: float = 0) -> uuid.UUID:
        if isinstance(proc, Running):
            assert proc.service_id is not None, f"{proc.name} is not a service"
            return proc.service_id
        return await super().service_id(proc, wait=wait)

    async def stop(self, timeout: float = 20) -> None:
        """Every component asked to stop and awaited (an error it ended with is raised, after
        the rest are stopped); then the processes and what ``Cluster`` cleans."""
        for running in self.running:
            running.request_stop()
        failed: BaseException | None = None
        for running in self.running:
            try:
                await asyncio.wait_for(asyncio.shield(running.task), timeout)
            except TimeoutError:
                running.task.cancel()
                await asyncio.gather(running.task, return_exceptions=True)
                failed = failed or AssertionError(f"{running.name} did not stop in {timeout}s")
            except Exception as exc:
                failed = failed or exc
        self.running.clear()
        await super().stop(timeout)
        if failed is not None:
            raise failed
