"""``orch``: the one command for operators. Environment is read here, at the edge."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from orch.api_commands import err, kinds, observers_app, out, pools, services_app
from orch_contracts import __version__

if TYPE_CHECKING:
    import asyncio
    import socket

    from orch.cluster import LocalCluster
    from orch_contracts.settings import CommonSettings

# The server's modules (settings, drivers, preflight) are imported by the commands that run
# servers: an API command or --version needs none of them (they took 0.5 s of every call).

app = typer.Typer(
    help="observer-orchestrator: infinite tasks, exactly once, on many servers.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(observers_app, name="observers")
app.add_typer(services_app, name="services")
app.command("kinds")(kinds)
app.command("pools")(pools)
S = TypeVar("S", bound="CommonSettings")
ServersWait = Annotated[
    float,
    typer.Option(help="seconds to wait for Postgres and RabbitMQ at start", envvar="ORCH_WAIT"),
]


def _version(value: bool) -> None:
    if value:
        out.print(f"observer-orchestrator {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version")
    ] = False,
) -> None:
    """Exit codes: 0 done, 1 the action failed, 2 the command or its settings are wrong."""


def _fail(message: str, code: int = 1) -> NoReturn:
    from orch.api_commands import shown
    from orch_contracts.masking import mask

    err.print(f"[red]error:[/red] {shown(mask(message))}", highlight=False)
    raise typer.Exit(code)


def _settings(cls: type[S], **overrides: Any) -> S:
    from pydantic import ValidationError

    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"]) or "settings"
            lines.append(f"ORCH_{field.upper()}: {e['msg']}")
        _fail("; ".join(lines), 2)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run a server's main coroutine on uvloop where it is installed (it roughly halves the
    event loop's own cost per request and per delivery), else on asyncio's loop; with the
    garbage collector at a server's pace (``orch_contracts.heap``)."""
    import asyncio

    from orch_contracts import heap

    heap.settle()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _run(settings: CommonSettings, wait: float, run: Callable[[Any], int]) -> NoReturn:
    """Load the kinds, check the servers (waiting up to ``wait``), run; exit with its code."""
    import asyncio
    import os

    from orch_contracts import tracing
    from orch_contracts.errors import StartupError
    from orch_contracts.kinds import load_kinds
    from orch_contracts.preflight import check_servers

    try:
        tracing.check(os.environ)  # here, before any fork: a wrong setting is one line
        kinds = load_kinds(settings.kind_module_list)
        asyncio.run(check_servers(settings, wait=wait))
        code = run(kinds)
    except StartupError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
def migrate() -> None:
    """Create the database if needed and apply every migration."""
    from orch.database import migrate as run
    from orch_contracts.errors import StartupError
    from orch_contracts.settings import CommonSettings

    settings = _settings(CommonSettings)
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
    workers: Annotated[
        int | None, typer.Option(help="processes serving the port (each a full replica)")
    ] = None,
    wait: ServersWait = 0,
) -> None:
    """Run the HTTP API (and, if elected, the background loops)."""
    from orch_contracts import logs
    from orch_manager.leader import new_holder_id
    from orch_manager.serving import serve
    from orch_manager.settings import ManagerSettings

    settings = _settings(ManagerSettings, host=host, port=port, workers=workers)
    if settings.workers == 1:
        replica = new_holder_id()
        logs.configure(settings.log_level, settings.log_format, replica=replica)
        _run(
            settings,
            wait,
            lambda kinds: _traced("manager", replica, serve, settings, kinds, replica),
        )
    logs.configure(settings.log_level, settings.log_format)
    _run(settings, wait, lambda kinds: _serve_workers(settings, kinds))


def _traced(role: str, instance: str, serve: Any, *args: Any) -> int:
    """Run ``serve(*args)`` to its end, traced if the environment asks (``orch_contracts.tracing``),
    and export what is left before the process ends."""
    import os

    from orch_contracts import tracing

    tracing.configure(role, os.environ, instance=instance)
    try:
        return run_loop(serve(*args))
    finally:
        tracing.shutdown()


def _serve_workers(settings: Any, kinds: Any) -> int:
    """``settings.workers`` replicas sharing one listening socket."""
    from orch.workers import run_workers
    from orch_contracts import logs
    from orch_manager.serving import serve

    def worker(sock: socket.socket, replica: str) -> int:
        logs.configure(settings.log_level, settings.log_format, replica=replica)
        return _traced("manager", replica, serve, settings, kinds, replica, sock)

    return run_workers(settings.host, settings.port, settings.workers, worker)


@app.command()
def service(
    name: Annotated[str | None, typer.Option(help="service name shown in the API")] = None,
    worker_count: Annotated[int | None, typer.Option(help="observers it runs at once")] = None,
    pool: Annotated[
        str | None,
        typer.Option(help="the pool it joins: it runs only that pool's observers [default]"),
    ] = None,
    wait: ServersWait = 0,
) -> None:
    """Run one observer service."""
    from observer_service.main import serve
    from observer_service.settings import ServiceSettings
    from orch_contracts import logs

    settings = _settings(ServiceSettings, name=name, worker_count=worker_count, pool=pool)
    logs.configure(settings.log_level, settings.log_format, service=settings.name)
    until = time.monotonic() + wait  # the check's wait and the first connections' share it
    _run(
        settings,
        wait,
        lambda kinds: _traced(
            "service", settings.name, functools.partial(serve, wait_until=until), settings, kinds
        ),
    )


@app.command()
def up(
    services: Annotated[int, typer.Option(help="observer services to start")] = 2,
    worker_count: Annotated[int, typer.Option(help="worker count of each service")] = 10,
    port: Annotated[int, typer.Option(help="port of the API")] = 8000,
) -> None:
    """Migrate, then run a manager and N services on this machine until Ctrl-C."""
    import asyncio

    migrate()
    try:
        asyncio.run(_up(services, worker_count, port))
    except RuntimeError as exc:
        _fail(str(exc))


async def _broker_advice() -> str | None:
    from orch_contracts.amqp import connect_first
    from orch_contracts.settings import CommonSettings
    from orch_contracts.topology import broker_version, consumer_timeout_advice

    connection, _ = await connect_first(CommonSettings().amqp_urls, timeout=5)
    async with connection:
        return consumer_timeout_advice(broker_version(connection))


async def _up(services: int, worker_count: int, port: int) -> None:
    import asyncio
    import signal

    from orch.api_commands import shown
    from orch.cluster import LocalCluster, free_port

    if advice := await _broker_advice():
        err.print(f"[yellow]warning:[/yellow] {shown(advice)}", highlight=False)
    cluster = LocalCluster(env={})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start_manager(port)
        metrics = []
        for i in range(services):
            # Each service serves its metrics (the dashboard's half about services); the broker
            # advice was given once, above, and is not repeated by each service.
            name, metrics_port = f"local-{i + 1}", free_port()
            await cluster.start_service(
                name, worker_count, ORCH_METRICS_PORT=metrics_port, ORCH_BROKER_ADVICE="false"
            )
            metrics.append(f"{name}: http://127.0.0.1:{metrics_port}/metrics")
        out.print(
            f"console: http://127.0.0.1:{port}/console  API: http://127.0.0.1:{port} "
            f"(schema: /openapi.json); {services} services x {worker_count} workers. "
            "Ctrl-C stops everything.\n"
            f"metrics: manager: http://127.0.0.1:{port}/metrics"
            + "".join(f"\n  {m}" for m in metrics)
        )
        if cluster.token:
            out.print(
                f"API token (admin, for this run only): {cluster.token}\n"
                f"  export ORCH_TOKEN={cluster.token}   # for the orch command"
            )
        await _supervise(cluster, stop)
        out.print("stopping…")
    finally:
        await cluster.stop()


#: A process that ran this long before it exited is started again at once (its backoff reset).
STEADY = 30.0


async def _supervise(cluster: LocalCluster, stop: asyncio.Event) -> None:
    """Start again, with backoff, every process of the cluster that exits, as compose's
    ``restart`` does, until ``stop`` is set: a service killed on purpose shows its observers
    moving, and the cluster stays up."""
    import asyncio

    from orch_contracts.backoff import Backoff

    backoffs: dict[str, Backoff] = {}
    started = {p.name: time.monotonic() for p in cluster.procs}
    due: dict[str, float] = {}  # name -> when to start it again
    while not stop.is_set():
        now = time.monotonic()
        for p in list(cluster.procs):
            if p.alive or p.name in due:
                continue
            backoff = backoffs.setdefault(p.name, Backoff(1.0, 30.0, jitter=0.2))
            if now - started[p.name] >= STEADY:
                backoff.reset()
            delay = backoff.next()
            due[p.name] = now + delay
            err.print(
                f"[yellow]{p.name} (pid {p.pid}) exited with code {p.popen.returncode}; "
                f"starting it again in {delay:.1f} s[/yellow]",
                highlight=False,
            )
        for name, when in list(due.items()):
            if when <= now:
                del due[name]
                old = next(p for p in cluster.procs if p.name == name)
                new = cluster.respawn(old)
                started[name] = time.monotonic()
                out.print(f"{name} started again (pid {new.pid})", highlight=False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


@app.command()
def health(
    url: Annotated[
        str | None,
        typer.Option(help="what to ask; default: this machine's manager, /healthz"),
    ] = None,
) -> None:
    """Exit 0 when the process answers (a container's HEALTHCHECK): the manager's /healthz, or
    a service's metrics port."""
    import os

    import httpx

    target = url or f"http://127.0.0.1:{os.environ.get('ORCH_PORT', '8000')}/healthz"
    try:
        ok = httpx.get(target, timeout=3).status_code == 200
    except httpx.HTTPError as exc:
        _fail(f"{target}: {exc}")
    if not ok:
        _fail(f"{target} is not healthy")


@app.command("broker-policy")
def broker_policy(
    max_length: Annotated[
        int, typer.Option(min=1, help="messages the error queue keeps (the newest)")
    ] = 100_000,
    apply: Annotated[bool, typer.Option(help="apply it with rabbitmqctl on this machine")] = False,
    management: Annotated[
        str | None,
        typer.Option(help="apply it through this management API (http://host:15672)"),
    ] = None,
) -> None:
    """Limit the error queue's length with a broker policy (it would grow for ever)."""
    import shlex

    from orch import broker_policy as bp
    from orch_contracts.settings import CommonSettings

    settings = _settings(CommonSettings)
    # Policies are cluster-wide: any node's URL names the vhost and the credentials.
    amqp_url = settings.amqp_urls[0]
    topology, vhost = settings.topology, bp.vhost_of(amqp_url)
    try:
        if management:
            done = bp.apply_with_management(topology, max_length, amqp_url, management)
        elif apply:
            done = bp.apply_with_rabbitmqctl(topology, max_length, vhost)
        else:
            command = shlex.join(bp.rabbitmqctl_args(topology, max_length, vhost))
            typer.echo("run on the broker's machine (or pass --apply / --management URL):")
            typer.echo(f"  {command}")
            return
    except (RuntimeError, OSError) as exc:
        _fail(f"could not apply the policy: {exc}")
    out.print(f"{topology.error_queue} keeps at most {max_length} messages ({done})")


outputs_app = typer.Typer(help="What observers emit.", no_args_is_help=True)
app.add_typer(outputs_app, name="outputs")


@outputs_app.command("tail")
def outputs_tail(
    kind: Annotated[str | None, typer.Option(help="only this kind's records")] = None,
    observer: Annotated[
        str | None, typer.Option(help="only this observer's records (its id or name)")
    ] = None,
    json_lines: Annotated[
        bool, typer.Option("--json", help="one JSON object per record, whole")
    ] = False,
) -> None:
    """Print records as they are published on <prefix>.outputs (a queue of its own, gone when
    this ends; Ctrl-C ends it), and every gap in an observer's seqs."""
    import asyncio

    from orch.outputs_tail import tail
    from orch_contracts.errors import BrokerUnavailable
    from orch_contracts.settings import CommonSettings

    settings = _settings(CommonSettings)
    piped = False  # whoever read our output went away (``| head -2``)

    async def main() -> int:
        import asyncio
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def show(text: str) -> None:
            nonlocal piped
            if piped:
                return
            try:
                print(text, flush=True)
            except BrokenPipeError:
                piped = True
                stop.set()

        reader = await tail(
            settings, kind=kind, observer=observer, show=show, json_lines=json_lines, stop=stop
        )
        if not piped:
            gaps = f", {len(reader.gaps)} gap(s)" if reader.gaps else ""
            err.print(f"{reader.delivered} record(s), {reader.repeats} repeat(s){gaps}")
        return 0

    try:
        asyncio.run(main())
    except BrokerUnavailable as exc:
        _fail(f"the broker is unavailable: {exc}")
    if piped:
        # As a Unix tool ends on a broken pipe: nothing said, 128 + SIGPIPE; what is left in
        # stdout's buffer goes nowhere (Python would complain flushing it at exit).
        import os
        import signal
        import sys

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(128 + signal.SIGPIPE)


token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("new")
def token_new(
    name: Annotated[str, typer.Argument(help="who or what will use it (logged with each call)")],
    role: Annotated[str, typer.Option(help="read (look) or admin (also change)")] = "read",
) -> None:
    """Make an API token: the token goes to its user, the entry to ORCH_API_TOKENS (which
    keeps only its SHA-256 digest)."""
    from orch_manager.auth import Role, new_token

    if role not in ("read", "admin") or ":" in name or "," in name or not name.strip():
        _fail("NAME must not contain ':' or ',' and --role must be read or admin", 2)
    token, entry = new_token(name.strip(), Role(role))
    typer.echo(f"token: {token}\nORCH_API_TOKENS entry: {entry}")


@app.command()
def verify(
    kinds_: Annotated[
        str | None,
        typer.Option(
            "--kinds",
            help="modules that define your kinds, comma-separated (default: ORCH_KIND_MODULES)",
        ),
    ] = None,
    observer: Annotated[
        list[str] | None,
        typer.Option(
            help="observers to create: KIND[*COUNT][:PARAMS_JSON], repeatable "
            "(default: --each of every kind the modules define)"
        ),
    ] = None,
    params: Annotated[
        Path | None,
        typer.Option(help="a JSON file of {kind: params} for the kinds created by default"),
    ] = None,
    each: Annotated[int, typer.Option(min=1, max=1000, help="observers per kind by default")] = 3,
    seconds: Annotated[float, typer.Option(min=1, help="length of the fault campaign")] = 60,
    seed: Annotated[int | None, typer.Option(help="the schedule's seed (default: random)")] = None,
    faults: Annotated[
        str | None,
        typer.Option(
            help="faults and weights, e.g. kill,freeze=2 (default: all but broker restarts, alarms)"
        ),
    ] = None,
    every: Annotated[float, typer.Option(min=0.05, help="mean seconds between faults")] = 0.9,
    broker_restart: Annotated[
        bool,
        typer.Option(
            help="also restart the broker and raise its memory alarm (needs rabbitmqctl rights)"
        ),
    ] = False,
    services: Annotated[int, typer.Option(min=1, max=20, help="service processes")] = 3,
    worker_count: Annotated[int, typer.Option(min=1, help="slots per service")] = 40,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the verdict as JSON")
    ] = None,
    report: Annotated[Path, typer.Option(help="where the HTML report goes")] = Path(
        "orch-verify-report.html"
    ),
    keep: Annotated[
        Path | None, typer.Option(help="keep the processes' logs and witness files here")
    ] = None,
) -> None:
    """Prove the promise on your own kinds: a throw-away cluster, a seeded fault campaign, a
    verdict from what really ran. Exit 0 when no two copies ran at once, nothing was lost and
    every kind stopped within ORCH_SHUTDOWN_TIMEOUT; 1 otherwise."""
    import asyncio

    from observer_service.settings import ServiceSettings
    from orch_contracts.errors import InvalidParams, OrchError, StartupError
    from orch_contracts.kinds import load_kinds
    from orch_verify.campaign import ObserverSpec, parse_faults
    from orch_verify.run import Options, new_seed, params_hint, parse_observer
    from orch_verify.run import verify as run_verify

    settings = _settings(ServiceSettings)
    modules = [m.strip() for m in (kinds_ or settings.kind_modules).split(",") if m.strip()]
    if not modules:
        _fail("name the modules that define your kinds: --kinds module[,module]", 2)
    try:
        installed = load_kinds(modules)
        weights = parse_faults(faults, broker_restart=broker_restart)
        specs = [parse_observer(o) for o in observer or []]
        if not specs:
            given = json.loads(params.read_text()) if params is not None else {}
            if not isinstance(given, dict):
                raise ValueError(f"{params} must hold a JSON object of {{kind: params}}")
            own = [k for k, s in installed.items() if s.origin.split(":")[0] in modules]
            specs = [ObserverSpec(k, given.get(k, {}), each) for k in sorted(own)]
        for spec in specs:
            if spec.kind not in installed:
                raise ValueError(f"unknown kind {spec.kind!r}; installed: {', '.join(installed)}")
            try:
                installed[spec.kind].validate_params(spec.params)
            except InvalidParams as exc:
                if observer:
                    raise
                raise InvalidParams(f"{exc}; {params_hint(installed[spec.kind], each)}") from exc
    except (OSError, ValueError, StartupError, OrchError) as exc:
        _fail(str(exc), 2)
    if not specs:
        _fail(f"the modules {', '.join(modules)} define no kind", 2)
    server = _scratch_server(settings)
    options = Options(
        kind_modules=modules,
        observers=specs,
        seconds=seconds,
        seed=seed if seed is not None else new_seed(),
        weights=weights,
        every=every,
        services=services,
        worker_count=worker_count,
        shutdown_timeout=settings.shutdown_timeout,
        json_path=json_path,
        report_path=report,
        workdir=keep,
    )
    outcome = asyncio.run(run_verify(server, options, out))
    raise typer.Exit(0 if outcome.verdict.passed else 1)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(help="a small run (under two minutes)")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write JSON here")] = None,
    only: Annotated[str | None, typer.Option(help="comma-separated scenario names")] = None,
) -> None:
    """Start a throw-away local cluster and measure it against the targets."""
    from orch_bench.run import main
    from orch_bench.scenarios import SCENARIOS
    from orch_contracts.settings import CommonSettings

    settings = _settings(CommonSettings)
    names = [n.strip() for n in only.split(",")] if only else None
    unknown = set(names or ()) - set(SCENARIOS)
    if unknown:
        _fail(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    _scratch_server(settings)
    raise typer.Exit(main(settings, quick=quick, only=names, json_path=json_path))


def _scratch_server(settings: S) -> S:
    """For a tool that makes its own databases (``bench``, ``verify``): the settings on the
    server's ``postgres`` database, once the servers answer."""
    import asyncio

    from orch_contracts.errors import StartupError
    from orch_contracts.preflight import check_servers
    from orch_contracts.settings import on_database

    server = settings.model_copy(
        update={"database_url": on_database(settings.database_url, "postgres")}
    )
    try:
        asyncio.run(check_servers(server, need_schema=False, declare=False))
    except StartupError as exc:
        _fail(str(exc))
    return server
