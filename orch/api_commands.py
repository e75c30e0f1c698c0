"""``orch observers …``, ``orch services …`` and ``orch kinds``: every action of the API from a
terminal. Reads take ``--json``; a failed request prints the API's own message and exits 1."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orch.client import ApiError, Client, problem_text
from orch_contracts.logs import safe_text
from orch_contracts.statuses import ObserverStatus

#: Without a terminal (a pipe, a file) and without COLUMNS, lines are as wide as they need:
#: Rich would cut a table to 80 columns for a script that reads it.
UNBOUNDED = 4096


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    if "COLUMNS" in os.environ or stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNBOUNDED)


out = console()
err = console(stderr=True)

ApiOption = Annotated[
    str, typer.Option("--api", envvar="ORCH_API", help="the manager's URL", show_default=True)
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="ORCH_TOKEN", help="API token (sent as a bearer token)"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON, as the API returns it")]
ObserverArgument = Annotated[str, typer.Argument(help="the observer's id, or its name")]
DEFAULT_API = "http://127.0.0.1:8000"

observers_app = typer.Typer(
    help="Create, list, inspect and act on observers.", no_args_is_help=True
)
services_app = typer.Typer(
    help="List services; drain one before stopping it (undrain: take work again).",
    no_args_is_help=True,
)


def _client(api: str, token: str | None) -> Client:
    return Client(api, token, retries=0)  # a command says at once that the manager is away


def shown(value: object) -> str:
    """A value from the API (or a file) as the terminal may show it: Rich markup escaped, and
    control and bidi characters made visible (``\\x1b``), so that data can neither break the
    output nor steer the terminal."""
    return escape(safe_text(str(value)))


def _failed(exc: ApiError) -> typer.Exit:
    return _failure(str(exc))


def _failure(message: str) -> typer.Exit:
    """What the command was asked could not be done (exit 1)."""
    err.print(f"[red]error:[/red] {shown(message)}", highlight=False)
    return typer.Exit(1)


def _usage(message: str) -> typer.Exit:
    """Bad input to the command (exit 2), saying what would be right."""
    err.print(f"[red]error:[/red] {shown(message)}", highlight=False)
    return typer.Exit(2)


def _show_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def _read(api: str, token: str | None, path: str, as_json: bool, **params: Any) -> Any:
    """GET ``path``; with --json print it and return None, else return it for a table."""
    try:
        data = _client(api, token).get_json(path, **params)
    except ApiError as exc:
        raise _failed(exc) from None
    if as_json:
        _show_json(data)
        return None
    return data


# ---------------------------------------------------------------------------------- observers
def _observer_table(rows: list[dict[str, Any]], *, wide: bool = False) -> Table:
    """Observers, their ids whole (however narrow the terminal: an id is there to be copied);
    the service's id shortened to 8 characters unless ``wide``."""
    table = Table(show_edge=not wide)
    # Ids never wrap, fold or shrink; the other columns give way.
    table.add_column("id", no_wrap=True, min_width=36)
    for header in ("name", "kind", "status"):
        table.add_column(header)
    table.add_column("service", no_wrap=wide, min_width=36 if wide else None)
    for header in ("epoch", "restarts", "checkpointed"):
        table.add_column(header)
    for o in rows:
        # "processing" only with a live holder: else it waits (o["waiting"] says why).
        waits = bool(o.get("waiting")) and o["status"] in ("created", "processing")
        status = "waiting" if waits else shown(o["status"])
        style = {"failed": "red", "pausing": "yellow", "paused": "yellow"}.get(o["status"])
        style = "yellow" if waits else style
        restarts = str(o["restart_count"]) if o["restart_count"] else ""
        service = "" if waits else o["service_id"] or ""
        table.add_row(
            shown(o["id"]),
            shown(o["name"]),
            shown(o["kind"]),
            f"[{style}]{status}[/{style}]" if style else status,
            shown(service if wide else service[:8]),
            shown(o["epoch"]),
            f"[red]{shown(restarts)}[/red]" if restarts else "",
            shown((o.get("checkpointed_at") or "")[:19]),
        )
    return table


def _finite(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is not a finite number")
    return number


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads(text: str) -> Any:
    """JSON as the API takes it: NaN, the infinities and numbers too large for a float are
    refused with ValueError (Python's json module would read them)."""
    return json.loads(text, parse_float=_finite, parse_constant=_no_constant)


def _params(pairs: list[str], raw: str | None) -> dict[str, Any]:
    try:
        params: dict[str, Any] = loads(raw) if raw else {}
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--params") from None
    given: set[str] = set()
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--param")
        if key in given:
            raise typer.BadParameter(f"{key!r} is given twice", param_hint="--param")
        given.add(key)
        try:
            params[key] = loads(value)
        except json.JSONDecodeError:
            params[key] = value  # not JSON: the text itself
        except ValueError as exc:
            raise typer.BadParameter(f"{pair!r}: {exc}", param_hint="--param") from None
    return params


@observers_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="unique among observers that are not deleted")],
    kind: Annotated[str, typer.Argument(help="a registered kind (see `orch kinds`)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="KEY=VALUE (JSON values allowed)")
    ] = None,
    params_json: Annotated[str | None, typer.Option("--params", help="params as JSON")] = None,
    pool: Annotated[
        str | None, typer.Option(help="the pool it runs in (see `orch pools`) [default]")
    ] = None,
    version: Annotated[
        str | None, typer.Option(help="pin it to this version of its kind (see `orch kinds`)")
    ] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Start an observer."""
    body = {"name": name, "kind": kind, "params": _params(param or [], params_json)}
    if pool is not None:
        body["pool"] = pool
    if version is not None:
        body["version"] = version
    client = _client(api, token)
    try:
        slots = _slots(client)
        o = client.post_json("/observers", body)
    except ApiError as exc:
        raise _failed(exc) from None
    _show_json(o) if as_json else out.print(f"created {shown(o['id'])} ({shown(o['status'])})")
    _say_who_waits(1, slots)


@dataclass(frozen=True)
class Slots:
    """Slots of the services taking work (live, not draining), and the observers waiting."""

    capacity: int
    used: int
    waiting: int

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used - self.waiting)


def _slots(client: Client) -> Slots | None:
    """Before a create: what is free (None when this token may not read it)."""
    try:
        services = client.get_json("/services")
        waiting = client.get_json("/views/observers", status="created", limit=1)["total"]
    except ApiError:
        return None
    taking = [s for s in services if not s["is_deleted"] and not s["draining"]]
    return Slots(
        sum(s["worker_count"] for s in taking), sum(s["running"] for s in taking), int(waiting)
    )


def _say_who_waits(created: int, slots: Slots | None) -> None:
    """``N will wait``: created past the free slots (on standard error: --json stays whole)."""
    if slots is None or created <= slots.free:
        return
    if slots.capacity == 0:
        err.print(f"{created} will wait: no service is taking work", highlight=False)
    else:
        err.print(
            f"{created - slots.free} will wait: only {slots.free} free slots "
            f"(of {slots.capacity}, {slots.waiting} observers waiting before these)",
            highlight=False,
        )


#: Observers per POST /observers/batch (the API's most).
BATCH = 1000


@dataclass
class _Entry:
    """One observer of an import: where it is in the file (1-based), and its body, or why it
    could not be read."""

    where: str
    number: int
    body: Any = None
    error: str | None = None

    @property
    def label(self) -> str:
        name = self.body.get("name") if isinstance(self.body, dict) else None
        return f"{self.where} {self.number}" + (f" ({name})" if isinstance(name, str) else "")


def _observers_in(source: str) -> list[_Entry]:
    """A JSON array of observers (items numbered from 1), or one JSON object a line (numbered
    by their line in the file, from 1); ``-`` is standard input. A line that is not JSON is an
    entry of its own that failed: the others are still imported."""
    import sys
    from pathlib import Path

    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    if text.strip().startswith("["):
        items = loads(text)
        if not isinstance(items, list):
            raise typer.BadParameter("expected a JSON array of observers, or one a line")
        entries = [_Entry("item", i, body=item) for i, item in enumerate(items, start=1)]
    else:
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(_Entry("line", number, body=loads(line)))
            except json.JSONDecodeError as exc:
                entries.append(_Entry("line", number, error=f"not JSON: {exc.msg}"))
            except ValueError as exc:
                entries.append(_Entry("line", number, error=f"not JSON: {exc}"))
    if not entries:
        raise typer.BadParameter("expected a JSON array of observers, or one a line")
    return entries


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
    the body of a single create; one that fails (a line that is not JSON too) is reported with
    its line number (or its number in the array) and the API's reasons, and the others go on.
    Exits 1 when any failed."""
    from rich.progress import Progress

    try:
        entries = _observers_in(source)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="SOURCE") from None
    todo = [e for e in entries if e.error is None]
    client = _client(api, token)
    slots = _slots(client)
    answers: dict[int, dict[str, Any]] = {}  # id(entry) -> the API's item
    with Progress(console=err, transient=True, disable=as_json) as progress:
        task = progress.add_task("creating", total=len(todo))
        for first in range(0, len(todo), BATCH):
            batch = todo[first : first + BATCH]
            try:
                answer = client.post_json(
                    "/observers/batch", {"observers": [e.body for e in batch]}
                )
            except ApiError as exc:
                raise _failed(exc) from None
            for item in answer["items"]:
                answers[id(batch[item["index"]])] = item
            progress.advance(task, len(batch))
    results: list[dict[str, Any]] = []
    for e in entries:
        if e.error is not None:
            problem = {"title": "Bad Request", "status": 400, "detail": e.error}
            results.append({e.where: e.number, "status": 400, "problem": problem})
        else:
            item = {k: v for k, v in answers[id(e)].items() if k != "index"}
            results.append({e.where: e.number, **item})
    failed = [(e, r) for e, r in zip(entries, results, strict=True) if r["status"] != 201]
    created = len(results) - len(failed)
    if as_json:
        _show_json({"created": created, "failed": len(failed), "items": results})
    else:
        for e, r in failed:
            # A batch item's field errors sit under observers.INDEX: show them from the field.
            reason = problem_text(r["problem"], under=2)
            err.print(f"[red]{shown(e.label)}[/red]: {shown(reason)}", highlight=False)
        out.print(f"created {created}, failed {len(failed)}")
    _say_who_waits(created, slots)
    if failed:
        raise typer.Exit(1)


def _resolve(client: Client, ref: str) -> str:
    """The id of the observer ``ref`` names: an id as it is, or a name (unique among the
    observers not deleted; a deleted one answers to its name only when no live one has it)."""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    named = [o for page in _pages(client, name=ref, limit=1000) for o in page if o["name"] == ref]
    live = [o for o in named if o["status"] != ObserverStatus.DELETED.value]
    found = live or named
    if not found:
        raise _failure(f"no observer named {ref!r} (nor with that id)")
    if len(found) > 1:
        ids = ", ".join(str(o["id"]) for o in found)
        raise _failure(f"{len(found)} deleted observers were named {ref!r}: give an id ({ids})")
    return str(found[0]["id"])


def _pages(client: Client, **filters: Any) -> Iterator[list[dict[str, Any]]]:
    offset = filters.pop("offset", 0)
    while True:
        page = client.get_json("/observers", offset=offset, **filters)
        yield page["items"]
        if page["next_offset"] is None:
            return
        offset = page["next_offset"]


@observers_app.command("list")
def list_observers(
    status: Annotated[
        ObserverStatus | None, typer.Option(help="only this status", case_sensitive=False)
    ] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind")] = None,
    pool: Annotated[str | None, typer.Option(help="only this pool")] = None,
    name: Annotated[str | None, typer.Option(help="names containing this")] = None,
    param: Annotated[
        str | None,
        typer.Option(
            help="PATH=VALUE: params holding VALUE (JSON, else text) at PATH (keys joined by "
            "dots); an admin token's search"
        ),
    ] = None,
    service: Annotated[str | None, typer.Option(help="only held by this service id")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="rows per page")] = 100,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    every: Annotated[
        bool, typer.Option("--all-pages", "--all", help="every page, not just one")
    ] = False,
    deleted: Annotated[
        bool, typer.Option("--deleted", help="deleted observers too (as --status deleted does)")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="only the ids, one a line")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="the services' ids whole too")] = False,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List observers, oldest first, deleted ones left out (--deleted: in). Ids are shown whole
    (also with --json and -q)."""
    client = _client(api, token)
    filters = {
        "status": None if status is None else status.value,
        "kind": kind,
        "pool": pool,
        "name": name,
        "param": param,
        "service_id": service,
        "include_deleted": deleted,
    }
    rows: list[dict[str, Any]] = []
    try:
        for page in _pages(client, limit=limit, offset=offset, **filters):
            rows += page
            if not every:
                break
        if kind is not None and not rows:
            # Nothing of that kind: say so when the cluster does not know it (observers of a
            # kind no longer installed are still listed by it).
            installed = sorted(k["name"] for k in client.get_json("/kinds"))
            if kind not in installed:
                raise _usage(
                    f"unknown kind {kind!r}; installed kinds: {', '.join(installed) or 'none'}"
                )
    except ApiError as exc:
        raise _failed(exc) from None
    if as_json:
        _show_json(rows)
    elif quiet:
        for o in rows:
            typer.echo(safe_text(str(o["id"])))
    else:
        out.print(_observer_table(rows, wide=wide))


def _render_observer(o: dict[str, Any]) -> None:
    out.print(_observer_table([o], wide=True))
    if o.get("params"):
        out.print("params:", shown(json.dumps(o["params"])), highlight=False)
    if o["checkpoint"] is not None:
        out.print("checkpoint:", shown(json.dumps(o["checkpoint"])), highlight=False)
    if o["last_error"]:
        out.print(f"[red]last error:[/red] {shown(o['last_error'])}", highlight=False)
    if o.get("traceback"):
        for line in o["traceback"].splitlines():
            out.print(f"  {shown(line)}", highlight=False)
    if o.get("waiting"):
        out.print(f"[yellow]waiting:[/yellow] {shown(o['waiting'])}", highlight=False)
    pinned = f", version {o['kind_version']}" if o.get("kind_version") else ""
    out.print(f"pool: {shown(o.get('pool', 'default'))}{shown(pinned)}", highlight=False)


def _render_events(rows: list[dict[str, Any]]) -> None:
    table = Table("at", "event", "service", "epoch", "by", "detail")
    for e in rows:
        epoch = "" if e["epoch"] is None else str(e["epoch"])
        service = e.get("service_name") or (e["service_id"] or "")[:8]
        table.add_row(
            shown(e["at"][:23]),
            shown(e["event"]),
            shown(service),
            epoch,
            shown(e.get("actor") or ""),
            shown(e["detail"] or ""),
        )
    out.print(table)


def _reader(name: str, suffix: str, render: Callable[[Any], None], doc: str) -> None:
    """``orch observers NAME ID [--json]``: one read about one observer."""

    def command(
        observer: ObserverArgument,
        api: ApiOption = DEFAULT_API,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        try:
            observer_id = _resolve(_client(api, token), observer)
        except ApiError as exc:
            raise _failed(exc) from None
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
    try:
        observer_id = _resolve(client, observer_id)
        path = f"/observers/{observer_id}"
        o = client.request(method, path + suffix)
        out.print(f"{shown(o['id'])}: {shown(o['status'])}")
        if wait and o["status"] != settled:
            client.wait(
                f"{observer_id} to be {settled}",
                lambda: client.get_json(path)["status"] == settled,
                timeout=timeout,
            )
            out.print(f"{shown(o['id'])}: {settled}")
    except ApiError as exc:
        raise _failed(exc) from None


def _act_on_many(
    action: str, selector: dict[str, Any], limit: int, *, api: str, token: str | None
) -> None:
    """One action on every observer a selector takes (``POST /observers/actions``): a line a
    failure, then the count; exit 1 when any failed."""
    try:
        answer = _client(api, token).post_json(
            "/observers/actions", {"action": action, "selector": selector, "limit": limit}
        )
    except ApiError as exc:
        raise _failed(exc) from None
    for item in answer["items"]:
        if item["status"] != 200:
            reason = problem_text(item["problem"])
            err.print(f"[red]{shown(item['id'])}[/red]: {shown(reason)}", highlight=False)
    more = f"; more match: --limit {limit} took the oldest" if answer["more"] else ""
    out.print(f"{action}: {answer['done']} done, {answer['failed']} failed{more}")
    if answer["failed"]:
        raise typer.Exit(1)


ObserverArg = Annotated[str | None, typer.Argument(help="one observer: its id, or its name")]
KindSelect = Annotated[str | None, typer.Option(help="every observer of this kind")]
PoolSelect = Annotated[str | None, typer.Option(help="every observer of this pool")]
StatusSelect = Annotated[
    ObserverStatus | None,
    typer.Option(help="every observer in this status", case_sensitive=False),
]
PrefixSelect = Annotated[str | None, typer.Option(help="every observer whose name starts so")]


def _selector(
    observer: str | None,
    kind: str | None,
    pool: str | None,
    status: ObserverStatus | None,
    name_prefix: str | None,
) -> dict[str, Any]:
    """The selector the options make (empty for one observer); a usage error unless exactly
    one of the two is given."""
    selector = {
        k: v
        for k, v in (
            ("kind", kind),
            ("pool", pool),
            ("status", None if status is None else status.value),
            ("name_prefix", name_prefix),
        )
        if v is not None
    }
    if (observer is None) == (not selector):
        raise _usage(
            "give one observer (an id or a name), or --kind, --pool, --status, --name-prefix"
        )
    return selector


def _action(name: str, method: str, suffix: str, settled: str, doc: str) -> None:
    """``orch observers NAME ID|NAME [--wait]``: one state change, then (--wait) its outcome;
    or ``--kind/--status/--name-prefix``: the same on every observer they select."""

    def command(
        observer: ObserverArg = None,
        kind: KindSelect = None,
        pool: PoolSelect = None,
        status: StatusSelect = None,
        name_prefix: PrefixSelect = None,
        limit: Annotated[
            int, typer.Option(min=1, max=10_000, help="with a selector: at most this many")
        ] = 1000,
        wait: WaitOption = False,
        timeout: TimeoutOption = 60,
        api: ApiOption = DEFAULT_API,
        token: TokenOption = None,
    ) -> None:
        selector = _selector(observer, kind, pool, status, name_prefix)
        if observer is None:
            if wait:
                raise _usage("--wait waits for one observer; a selector acts on many")
            _act_on_many(name, selector, limit, api=api, token=token)
            return
        _act(observer, method, suffix, settled, wait=wait, timeout=timeout, api=api, token=token)

    command.__doc__ = (
        f"{doc} With --kind, --pool, --status or --name-prefix: every one they select."
    )
    observers_app.command(name)(command)


@observers_app.command("move")
def move(
    observer: ObserverArg = None,
    kind: KindSelect = None,
    pool: PoolSelect = None,
    status: StatusSelect = None,
    name_prefix: PrefixSelect = None,
    to_pool: Annotated[str | None, typer.Option(help="the pool they move to")] = None,
    version: Annotated[
        str | None, typer.Option(help="pin them to this version of their kind")
    ] = None,
    any_version: Annotated[
        bool, typer.Option("--any-version", help="unpin them: any version runs them")
    ] = False,
    percent: Annotated[
        float, typer.Option(min=0.001, max=100, help="move this share of those selected")
    ] = 100,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="select at most this many")] = 1000,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Move observers to another pool (--to-pool) or version of their kind (--version,
    --any-version): each running one is handed over gracefully and resumes from its checkpoint
    where it now belongs. Moving them back is a rollback. Example: orch observers move --kind
    ws_feed --pool default --to-pool canary --percent 10."""
    selector = _selector(observer, kind, pool, status, name_prefix)
    body: dict[str, Any] = {"percent": percent, "limit": limit, "any_version": any_version}
    if to_pool is not None:
        body["to_pool"] = to_pool
    if version is not None:
        body["to_version"] = version
    client = _client(api, token)
    try:
        if observer is not None:
            selector = {"ids": [_resolve(client, observer)]}
        answer = client.post_json("/observers/move", {**body, "selector": selector})
    except ApiError as exc:
        raise _failed(exc) from None
    if as_json:
        _show_json(answer)
        return
    more = f"; more match: --limit {limit} took the oldest" if answer["more"] else ""
    out.print(
        f"moving {answer['moved']} of the {answer['matched']} selected{more}: each running "
        "one is handed over in turn (`orch observers list` shows where each runs)"
    )


@observers_app.command("edit")
def edit(
    observer: Annotated[str, typer.Argument(help="its id or name")],
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", help="KEY=VALUE to set (JSON values allowed)"),
    ] = None,
    params_json: Annotated[
        str | None, typer.Option("--params", help="a JSON object merged into its params")
    ] = None,
    unset: Annotated[
        list[str] | None, typer.Option("--unset", help="KEY to remove from its params")
    ] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """New params for a paused or failed observer, merged into its own and validated by its
    kind; its resume (or restart) starts with them. A running one: pause it, edit it, resume
    it. Example: orch observers edit btc -p interval=10 --unset headers."""
    patch = _params(param or [], params_json)
    for key in unset or []:
        if key in patch:
            raise _usage(f"{key!r} is both set and unset")
        patch[key] = None
    if not patch:
        raise _usage("nothing to change: give --param, --params or --unset")
    client = _client(api, token)
    try:
        path = f"/observers/{_resolve(client, observer)}"
        o = client.request("PATCH", path, json_={"params": patch})
    except ApiError as exc:
        raise _failed(exc) from None
    if as_json:
        _show_json(o)
        return
    out.print(f"edited {shown(o['name'])} ({shown(o['status'])}): its params are now")
    _show_json(o["params"])


_action("delete", "DELETE", "", "deleted", "Cancel an observer for good (--wait: until stopped).")
_action("pause", "POST", "/pause", "paused", "Stop an observer, keep its checkpoint (--wait).")
_action("resume", "POST", "/resume", "processing", "Start a paused observer again (--wait).")
_action("restart", "POST", "/restart", "processing", "Revive a failed one; restart a running one.")


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
    table = Table()
    table.add_column("id", no_wrap=True, min_width=36)  # whole, to be copied
    headers = ("name", "pool", "running", "host", "pid", "state", "last renewal", "memory", "cpu")
    for header in (*headers, "kinds"):
        table.add_column(header)
    for s in rows:
        state = "deleted" if s["is_deleted"] else "draining" if s["draining"] else "live"
        kinds = s.get("kinds")
        rss, cpu = s.get("rss_bytes"), s.get("cpu")
        table.add_row(
            shown(s["id"]),
            shown(s["name"]),
            shown(s.get("pool", "default")),
            f"{s['running']} / {s['worker_count']}",
            shown(s["host"]),
            shown(s["pid"]),
            state,
            shown(s["last_heartbeat_at"][:23]),
            "" if rss is None else f"{rss / 2**20:.0f} MiB",
            "" if cpu is None else f"{100 * cpu:.0f} %",
            "every kind (an earlier release)" if kinds is None else shown(", ".join(kinds)),
        )
    out.print(table)


ServiceIdArg = Annotated[
    str | None,
    typer.Argument(help="a service's id, or the name of the one live service that has it"),
]


def _service_ids(client: Client, service_id: str | None, name: str | None) -> list[str]:
    if (service_id is None) == (name is None):
        raise _usage("give a service id or --name" + (", not both" if service_id else ""))
    return [service_id] if service_id else _ids_named(client, name or "")


@services_app.command("drain")
def services_drain(
    service_id: ServiceIdArg = None,
    name: Annotated[
        str | None, typer.Option(help="drain the live service(s) with this name instead")
    ] = None,
    wait: Annotated[bool, typer.Option(help="wait until it runs nothing (a preStop hook)")] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 120,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
) -> None:
    """Move every observer off a service and stop it taking new ones, before stopping it
    (`orch services undrain` lets it take work again)."""
    client = _client(api, token)
    try:
        ids = []
        for ref in _service_ids(client, service_id, name):
            s = client.post_json(f"/services/{quote(ref, safe='')}/drain")
            ids.append(s["id"])
            out.print(
                f"draining {shown(s['name'])} {shown(s['id'])} "
                f"({shown(s['running'])} observers to move)"
            )
        if wait:
            for sid in ids:
                client.wait(f"{sid} to run nothing", _empty(client, sid), timeout=timeout)
            out.print("drained: nothing runs there any more")
    except ApiError as exc:
        raise _failed(exc) from None


@services_app.command("undrain")
def services_undrain(
    service_id: ServiceIdArg = None,
    name: Annotated[
        str | None, typer.Option(help="undrain the live service(s) with this name instead")
    ] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
) -> None:
    """Let a drained service take work again (new observers, and moves to it)."""
    client = _client(api, token)
    try:
        for ref in _service_ids(client, service_id, name):
            s = client.post_json(f"/services/{quote(ref, safe='')}/undrain")
            out.print(f"taking work again: {shown(s['name'])} {shown(s['id'])}")
    except ApiError as exc:
        raise _failed(exc) from None


def _ids_named(client: Client, name: str) -> list[str]:
    ids = [s["id"] for s in client.get_json("/services") if s["name"] == name]
    if not ids:
        raise ApiError(f"no live service named {name!r}")
    return ids


def _empty(client: Client, service_id: str) -> Callable[[], bool]:
    def check() -> bool:
        live = [s for s in client.get_json("/services") if s["id"] == service_id]
        return not live or live[0]["running"] == 0

    return check


# -------------------------------------------------------------------------------------- pools
def pools(
    api: ApiOption = DEFAULT_API, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """Pools: each one's live services, slots, what runs, what nobody holds, its kinds."""
    rows = _read(api, token, "/pools", as_json)
    if rows is None:
        return
    table = Table("pool", "services", "running", "unheld", "kinds")
    for p in rows:
        kinds = p["kinds"]
        table.add_row(
            shown(p["name"]),
            shown(p["services"]),
            f"{p['running']} / {p['slots']}",
            shown(p["unheld"]),
            "every kind (an earlier release)" if kinds is None else shown(", ".join(kinds)),
        )
    out.print(table)


# -------------------------------------------------------------------------------------- kinds
def kinds(
    api: ApiOption = DEFAULT_API, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """The kinds this cluster can run, with their params and restart policy."""
    rows = _read(api, token, "/kinds", as_json)
    if rows is None:
        return
    table = Table("kind", "description", "params", "restarts", "versions", "pools")
    for k in rows:
        props = (k["params_schema"] or {}).get("properties", {})
        policy = k["restart_policy"]
        table.add_row(
            shown(k["name"]),
            shown(k["description"]),
            shown(", ".join(props)),
            f"{policy['max_restarts']} per {policy['reset_after']:g}s",
            shown(", ".join(k.get("versions") or [k.get("version", "1")])),
            shown(", ".join(k.get("pools") or [])),
        )
    out.print(table)
