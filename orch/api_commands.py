"""``orch observers …``, ``orch services …`` and ``orch kinds``: every action of the API from a
terminal. Reads take ``--json``; a failed request prints the API's own message and exits 1."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from orch.client import ApiError, Client

out = Console()
err = Console(stderr=True)

ApiOption = Annotated[
    str, typer.Option("--api", envvar="ORCH_API", help="the manager's URL", show_default=True)
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="ORCH_TOKEN", help="API token (sent as a bearer token)"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON, as the API returns it")]
DEFAULT_API = "http://127.0.0.1:8000"

observers_app = typer.Typer(
    help="Create, list, inspect and act on observers.", no_args_is_help=True
)
services_app = typer.Typer(
    help="List services; drain one before stopping it.", no_args_is_help=True
)


def _client(api: str, token: str | None) -> Client:
    return Client(api, token)


def _failed(exc: ApiError) -> typer.Exit:
    err.print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(1)


def _show_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def _read(api: str, token: str | None, path: str, as_json: bool, **params: Any) -> Any:
    """GET ``path``; with --json print it and return None, else return it for a table."""
    try:
        data = _client(api, token).get(path, **params)
    except ApiError as exc:
        raise _failed(exc) from None
    if as_json:
        _show_json(data)
        return None
    return data


# ---------------------------------------------------------------------------------- observers
def _observer_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "kind", "status", "service", "epoch", "restarts", "checkpointed")
    for o in rows:
        style = {"failed": "red", "pausing": "yellow", "paused": "yellow"}.get(o["status"])
        restarts = str(o["restart_count"]) if o["restart_count"] else ""
        table.add_row(
            o["id"],
            o["name"],
            o["kind"],
            f"[{style}]{o['status']}[/{style}]" if style else o["status"],
            (o["service_id"] or "")[:8],
            str(o["epoch"]),
            f"[red]{restarts}[/red]" if restarts else "",
            (o.get("checkpointed_at") or "")[:19],
        )
    return table


def _params(pairs: list[str], raw: str | None) -> dict[str, Any]:
    params: dict[str, Any] = json.loads(raw) if raw else {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--param")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@observers_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="unique among observers that are not deleted")],
    kind: Annotated[str, typer.Argument(help="a registered kind (see `orch kinds`)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="KEY=VALUE (JSON values allowed)")
    ] = None,
    params_json: Annotated[str | None, typer.Option("--params", help="params as JSON")] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Start an observer."""
    try:
        body = {"name": name, "kind": kind, "params": _params(param or [], params_json)}
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--params") from None
    try:
        o = _client(api, token).post("/observers", body)
    except ApiError as exc:
        raise _failed(exc) from None
    _show_json(o) if as_json else out.print(f"created {o['id']} ({o['status']})")


#: Observers per POST /observers/batch (the API's most).
BATCH = 1000


def _observers_in(source: str) -> list[Any]:
    """A JSON array of observers, or one JSON object a line; ``-`` is standard input."""
    import sys
    from pathlib import Path

    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    stripped = text.strip()
    if stripped.startswith("["):
        items = json.loads(stripped)
    else:
        items = [json.loads(line) for line in stripped.splitlines() if line.strip()]
    if not isinstance(items, list) or not items:
        raise typer.BadParameter("expected a JSON array of observers, or one a line")
    return items


@observers_app.command("import")
def import_observers(
    source: Annotated[
        str,
        typer.Argument(
            help="a file with a JSON array of observers (or one JSON object a line), - for stdin"
        ),
    ],
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create many observers, a thousand a request (POST /observers/batch). Each is shaped like
    the body of a single create; one that fails is reported and the others go on. Exits 1 when
    any failed."""
    from rich.progress import Progress

    try:
        items = _observers_in(source)
    except (OSError, json.JSONDecodeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="SOURCE") from None
    client = _client(api, token)
    results: list[dict[str, Any]] = []
    with Progress(console=err, transient=True, disable=as_json) as progress:
        task = progress.add_task("creating", total=len(items))
        for first in range(0, len(items), BATCH):
            try:
                answer = client.post(
                    "/observers/batch", {"observers": items[first : first + BATCH]}
                )
            except ApiError as exc:
                raise _failed(exc) from None
            results += [{**item, "index": item["index"] + first} for item in answer["items"]]
            progress.advance(task, len(answer["items"]))
    failed = [r for r in results if r["status"] != 201]
    if as_json:
        _show_json({"created": len(results) - len(failed), "failed": len(failed), "items": results})
    else:
        for r in failed:
            name = items[r["index"]].get("name") if isinstance(items[r["index"]], dict) else None
            err.print(
                f"[red]#{r['index']}[/red] {name or ''}: {r['problem']['detail']}", highlight=False
            )
        out.print(f"created {len(results) - len(failed)}, failed {len(failed)}")
    if failed:
        raise typer.Exit(1)


def _pages(client: Client, **filters: Any) -> Iterator[list[dict[str, Any]]]:
    offset = filters.pop("offset", 0)
    while True:
        page = client.get("/observers", offset=offset, **filters)
        yield page["items"]
        if page["next_offset"] is None:
            return
        offset = page["next_offset"]


@observers_app.command("list")
def list_observers(
    status: Annotated[str | None, typer.Option(help="only this status")] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind")] = None,
    name: Annotated[str | None, typer.Option(help="names containing this")] = None,
    service: Annotated[str | None, typer.Option(help="only held by this service id")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="rows per page")] = 100,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    every: Annotated[bool, typer.Option("--all", help="every page, not just one")] = False,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List observers, oldest first."""
    client = _client(api, token)
    filters = {"status": status, "kind": kind, "name": name, "service_id": service}
    rows: list[dict[str, Any]] = []
    try:
        for page in _pages(client, limit=limit, offset=offset, **filters):
            rows += page
            if not every:
                break
    except ApiError as exc:
        raise _failed(exc) from None
    _show_json(rows) if as_json else out.print(_observer_table(rows))


def _render_observer(o: dict[str, Any]) -> None:
    out.print(_observer_table([o]))
    if o["checkpoint"] is not None:
        out.print("checkpoint:", json.dumps(o["checkpoint"]), highlight=False)
    if o["last_error"]:
        out.print(f"[red]last error:[/red] {o['last_error']}", highlight=False)


def _render_events(rows: list[dict[str, Any]]) -> None:
    table = Table("at", "event", "service", "epoch", "detail")
    for e in rows:
        epoch = "" if e["epoch"] is None else str(e["epoch"])
        service = (e["service_id"] or "")[:8]
        table.add_row(e["at"][:23], e["event"], service, epoch, e["detail"] or "")
    out.print(table)


def _reader(name: str, suffix: str, render: Callable[[Any], None], doc: str) -> None:
    """``orch observers NAME ID [--json]``: one read about one observer."""

    def command(
        observer_id: str,
        api: ApiOption = DEFAULT_API,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        data = _read(api, token, f"/observers/{observer_id}{suffix}", as_json)
        if data is not None:
            render(data)

    command.__doc__ = doc
    observers_app.command(name)(command)


_reader("get", "", _render_observer, "One observer: where it runs, its epoch, checkpoint, error.")
_reader("events", "/events", _render_events, "An observer's history: takes, releases, restarts.")


WaitOption = Annotated[bool, typer.Option(help="wait until the action has settled")]
TimeoutOption = Annotated[float, typer.Option(help="seconds --wait waits")]


def _act(
    observer_id: str,
    method: str,
    suffix: str,
    settled: str,
    *,
    wait: bool,
    timeout: float,
    api: str,
    token: str | None,
) -> None:
    client = _client(api, token)
    path = f"/observers/{observer_id}"
    try:
        o = client.request(method, path + suffix)
        out.print(f"{o['id']}: {o['status']}")
        if wait and o["status"] != settled:
            client.wait(
                f"{observer_id} to be {settled}",
                lambda: client.get(path)["status"] == settled,
                timeout=timeout,
            )
            out.print(f"{o['id']}: {settled}")
    except ApiError as exc:
        raise _failed(exc) from None


def _action(name: str, method: str, suffix: str, settled: str, doc: str) -> None:
    """``orch observers NAME ID [--wait]``: one state change, then (--wait) its outcome."""

    def command(
        observer_id: str,
        wait: WaitOption = False,
        timeout: TimeoutOption = 60,
        api: ApiOption = DEFAULT_API,
        token: TokenOption = None,
    ) -> None:
        _act(observer_id, method, suffix, settled, wait=wait, timeout=timeout, api=api, token=token)

    command.__doc__ = doc
    observers_app.command(name)(command)


_action("delete", "DELETE", "", "deleted", "Cancel an observer for good (--wait: until stopped).")
_action("pause", "POST", "/pause", "paused", "Stop an observer, keep its checkpoint (--wait).")
_action("resume", "POST", "/resume", "processing", "Start a paused observer again (--wait).")
_action("restart", "POST", "/restart", "processing", "Revive a failed observer (--wait).")


# ----------------------------------------------------------------------------------- services
@services_app.command("list")
def services_list(
    every: Annotated[bool, typer.Option("--all", help="deleted services too")] = False,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Services: their load (running of worker_count), draining, lease."""
    rows = _read(api, token, "/services", as_json, include_deleted=every or None)
    if rows is None:
        return
    table = Table("id", "name", "running", "host", "pid", "state", "last renewal")
    for s in rows:
        state = "deleted" if s["is_deleted"] else "draining" if s["draining"] else "live"
        table.add_row(
            s["id"],
            s["name"],
            f"{s['running']} / {s['worker_count']}",
            s["host"],
            str(s["pid"]),
            state,
            s["last_heartbeat_at"][:23],
        )
    out.print(table)


@services_app.command("drain")
def services_drain(
    service_id: Annotated[str | None, typer.Argument(help="a service id")] = None,
    name: Annotated[
        str | None, typer.Option(help="drain the live service(s) with this name instead")
    ] = None,
    wait: Annotated[bool, typer.Option(help="wait until it runs nothing (a preStop hook)")] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 120,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
) -> None:
    """Move every observer off a service and stop it taking new ones, before stopping it."""
    if (service_id is None) == (name is None):
        raise typer.BadParameter("give a service id or --name, not both", param_hint="ID")
    client = _client(api, token)
    try:
        ids = [service_id] if service_id else _ids_named(client, name or "")
        for sid in ids:
            s = client.post(f"/services/{sid}/drain")
            out.print(f"draining {s['name']} {s['id']} ({s['running']} observers to move)")
        if wait:
            for sid in ids:
                client.wait(f"{sid} to run nothing", _empty(client, sid), timeout=timeout)
            out.print("drained: nothing runs there any more")
    except ApiError as exc:
        raise _failed(exc) from None


def _ids_named(client: Client, name: str) -> list[str]:
    ids = [s["id"] for s in client.get("/services") if s["name"] == name]
    if not ids:
        raise ApiError(f"no live service named {name!r}")
    return ids


def _empty(client: Client, service_id: str) -> Callable[[], bool]:
    def check() -> bool:
        live = [s for s in client.get("/services") if s["id"] == service_id]
        return not live or live[0]["running"] == 0

    return check


# -------------------------------------------------------------------------------------- kinds
def kinds(
    api: ApiOption = DEFAULT_API, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """The kinds this cluster can run, with their params and restart policy."""
    rows = _read(api, token, "/kinds", as_json)
    if rows is None:
        return
    table = Table("kind", "description", "params", "restarts")
    for k in rows:
        props = (k["params_schema"] or {}).get("properties", {})
        policy = k["restart_policy"]
        table.add_row(
            k["name"],
            k["description"],
            ", ".join(props),
            f"{policy['max_restarts']} per {policy['reset_after']:g}s",
        )
    out.print(table)
