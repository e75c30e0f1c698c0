"""``orch``: the one command for operators. Environment is read here, at the edge."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console

from contracts.errors import StartupError
from contracts.preflight import check_servers

app = typer.Typer(
    help="observer-orchestrator: infinite tasks, exactly once, on many servers.",
    no_args_is_help=True,
    add_completion=False,
)
services_app = typer.Typer(
    help="Operate on observer services through the API.", no_args_is_help=True
)
app.add_typer(services_app, name="services")
err = Console(stderr=True)
out = Console()


def _fail(message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def _settings(cls: type, **overrides: object) -> object:
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"]) or "settings"
            lines.append(f"ORCH_{field.upper()}: {e['msg']}")
        _fail("; ".join(lines))


@app.command()
def migrate() -> None:
    """Create the database if needed and apply every migration."""
    from contracts.settings import CommonSettings
    from orch.database import migrate as run

    settings = _settings(CommonSettings)
    assert isinstance(settings, CommonSettings)
    try:
        created = run(settings)
    except StartupError as exc:
        _fail(str(exc))
    except Exception as exc:
        _fail(f"migration failed: {exc}")
    out.print(("created the database; " if created else "") + "schema is up to date")


@app.command()
def manager(
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    port: Annotated[int | None, typer.Option(help="port to listen on")] = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for Postgres and RabbitMQ")] = 0,
) -> None:
    """Run the HTTP API (and, if elected, the background loops)."""
    from contracts.kinds import load_kinds
    from manager.settings import ManagerSettings
    from observer_service.main import configure_logging

    settings = _settings(ManagerSettings, host=host, port=port)
    assert isinstance(settings, ManagerSettings)
    configure_logging()
    try:
        kinds = load_kinds(settings.kind_module_list)
        asyncio.run(check_servers(settings, wait=wait))
        code = asyncio.run(_serve_manager(settings, kinds))
    except StartupError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


async def _serve_manager(settings: Any, kinds: Any) -> int:
    """Serve until a signal (0), or until a task of the runtime dies (1)."""
    import uvicorn

    from manager.app import create_app
    from manager.runtime import ManagerRuntime

    runtime = ManagerRuntime(settings, kinds)
    config = uvicorn.Config(
        create_app(settings, runtime=runtime),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    fatal = asyncio.create_task(runtime.fatal.wait())
    await asyncio.wait([serving, fatal], return_when=asyncio.FIRST_COMPLETED)
    if fatal.done():
        server.should_exit = True
    else:
        fatal.cancel()
    await serving
    return 1 if runtime.fatal.is_set() else 0


@app.command()
def service(
    name: Annotated[str | None, typer.Option(help="service name shown in the API")] = None,
    worker_count: Annotated[int | None, typer.Option(help="observers it runs at once")] = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for Postgres and RabbitMQ")] = 0,
) -> None:
    """Run one observer service."""
    from contracts.kinds import load_kinds
    from observer_service.main import configure_logging, serve
    from observer_service.settings import ServiceSettings

    settings = _settings(ServiceSettings, name=name, worker_count=worker_count)
    assert isinstance(settings, ServiceSettings)
    configure_logging()
    try:
        kinds = load_kinds(settings.kind_module_list)
        asyncio.run(check_servers(settings, wait=wait))
        code = asyncio.run(serve(settings, kinds))
    except StartupError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
def up(
    services: Annotated[int, typer.Option(help="observer services to start")] = 2,
    worker_count: Annotated[int, typer.Option(help="worker count of each service")] = 10,
    port: Annotated[int, typer.Option(help="port of the API")] = 8000,
) -> None:
    """Migrate, then run a manager and N services on this machine until Ctrl-C."""
    migrate()
    try:
        asyncio.run(_up(services, worker_count, port))
    except RuntimeError as exc:
        _fail(str(exc))


async def _up(services: int, worker_count: int, port: int) -> None:
    from orch.cluster import LocalCluster

    cluster = LocalCluster(env={})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start_manager(port)
        for i in range(services):
            await cluster.start_service(f"local-{i + 1}", worker_count)
        out.print(
            f"API: http://127.0.0.1:{port}  (docs: http://127.0.0.1:{port}/docs); "
            f"{services} services x {worker_count} workers. Ctrl-C stops everything."
        )
        while not stop.is_set():
            if not all(p.alive for p in cluster.procs):
                err.print("[red]a process of the cluster exited; stopping the rest[/red]")
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        out.print("stopping…")
    finally:
        await cluster.stop()


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(help="a small run (under two minutes)")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write JSON here")] = None,
    only: Annotated[str | None, typer.Option(help="comma-separated scenario names")] = None,
) -> None:
    """Start a throw-away local cluster and measure it against the targets."""
    from contracts.settings import CommonSettings, on_database
    from orch_bench.run import main
    from orch_bench.scenarios import SCENARIOS

    settings = _settings(CommonSettings)
    assert isinstance(settings, CommonSettings)
    names = [n.strip() for n in only.split(",")] if only else None
    unknown = set(names or ()) - set(SCENARIOS)
    if unknown:
        _fail(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    # The benchmark makes its own databases: it needs the server, not the configured database.
    server = settings.model_copy(
        update={"database_url": on_database(settings.database_url, "postgres")}
    )
    try:
        asyncio.run(check_servers(server, need_schema=False))
    except StartupError as exc:
        _fail(str(exc))
    raise typer.Exit(main(settings, quick=quick, only=names, json_path=json_path))


ApiOption = Annotated[str, typer.Option("--api", envvar="ORCH_API", help="manager URL")]


@services_app.command("list")
def services_list(api: ApiOption = "http://127.0.0.1:8000") -> None:
    """Live services: id, name, running / worker_count, draining."""
    for s in _call("GET", f"{api}/services"):
        flag = " draining" if s["draining"] else ""
        out.print(f"{s['id']}  {s['name']:<20} {s['running']:>6} / {s['worker_count']}{flag}")


@services_app.command("drain")
def services_drain(
    service_id: Annotated[str, typer.Argument(help="id of the service (see `orch services list`)")],
    api: ApiOption = "http://127.0.0.1:8000",
) -> None:
    """Move every observer off a service and stop it taking new ones (before scaling it down)."""
    s = _call("POST", f"{api}/services/{service_id}/drain")
    out.print(f"draining {s['name']} ({s['running']} observers to move)")


def _call(method: str, url: str) -> Any:
    import httpx

    try:
        r = httpx.request(method, url, timeout=30)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the manager at {url}: {exc}")
    if r.status_code >= 400:
        detail = r.json().get("detail") if "json" in r.headers.get("content-type", "") else r.text
        _fail(f"{r.status_code}: {detail}")
    return r.json()
