"""The API from Python: ``Client`` (blocking) and ``AsyncClient`` (asyncio), typed.

::

    from orch.client import Client, NameTaken

    with Client("http://127.0.0.1:8000") as api:        # the token: ORCH_TOKEN, or token=
        try:
            o = api.create("btc", "ticker", params={"interval": 5})
        except NameTaken:
            o = api.get("btc")                           # an id or a name
        for o in api.observers(kind="ticker"):            # every page, one after the other
            print(o.name, o.status, o.waiting or o.service_id)

Every answer is a response model (``Observer``, ``Service``, …: frozen dataclasses, fields as
the API names them; a field the API adds later is ignored). Every failure is an error of the
project's tree (``orch_contracts.errors``) as well as an ``ApiError`` with the API's status and
problem document: ``NotFound``, ``NameTaken``, ``Conflict``, ``InvalidParams``, ``UnknownKind``,
``InvalidInput``, ``TooLarge``, ``Unauthorized``, ``Forbidden``, ``Unavailable`` (the manager
answered 503, or could not be reached). A 503 is retried ``retries`` times, after the wait its
``Retry-After`` asks (at most ``max_wait`` seconds): the manager answers 503 only when it
changed nothing. A request that could not be sent is retried only when it reads.

``Client`` speaks HTTP with the standard library (one connection a request, so that it costs
the command line, which uses it, no start-up time); ``AsyncClient`` with httpx.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from orch_contracts import errors

if typing.TYPE_CHECKING:
    import http.client

    import httpx

#: What a 401 adds: where a token comes from.
TOKEN_HINT = (
    "give an API token with --token TOKEN or the ORCH_TOKEN environment variable "
    "(`orch token new NAME --role admin` makes one; `orch up` prints one for its run)"
)
DEFAULT_URL = "http://127.0.0.1:8000"
#: The problem types of ``orch_manager.problems.PROBLEM_TYPES``.
_TYPES = "urn:observer-orchestrator:"


# ------------------------------------------------------------------------------------- errors
class ApiError(errors.OrchError):
    """A request that failed: ``status`` (None: the manager was not reached), the problem
    document the API answered with, and its message as one line."""

    def __init__(
        self, message: str, status: int | None = None, problem: Mapping[str, Any] | None = None
    ) -> None:
        Exception.__init__(self, message)
        self.status = status
        self.problem: Mapping[str, Any] = problem or {}

    @property
    def detail(self) -> str:
        return str(self.problem.get("detail", self))


class Unauthorized(ApiError):
    """401: no token, or one the manager does not know."""


class Forbidden(ApiError):
    """403: the token's role may not do this (a ``read`` token changing something)."""


class NotFound(ApiError, errors.NotFound):
    """404."""


class Conflict(ApiError, errors.Conflict):
    """409: the request contradicts the observer's state (resume one that is not paused, …)."""


class NameTaken(Conflict, errors.NameTaken):
    """409: a live observer has that name, or one that looks like it."""


class InvalidInput(ApiError, errors.InvalidInput):
    """422 (or 400): the request is not valid; ``problem["errors"]`` says where."""


class InvalidParams(InvalidInput, errors.InvalidParams):
    """422: the kind refused the params."""


class UnknownKind(InvalidInput, errors.UnknownKind):
    """422: no service (of that pool) runs the kind, or not in that version."""


class TooLarge(InvalidInput, errors.TooLarge):
    """413."""


class Unavailable(ApiError, errors.Transient):
    """503, or no answer: the manager, its database or its broker is away; try again.
    ``retry_after``: the seconds it asked to wait (None: it did not say)."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        problem: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status, problem)
        self.retry_after = retry_after


_BY_TYPE: dict[str, type[ApiError]] = {
    f"{_TYPES}name-taken": NameTaken,
    f"{_TYPES}unknown-kind": UnknownKind,
    f"{_TYPES}invalid-params": InvalidParams,
}
_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InvalidInput,
    503: Unavailable,
}


def problem_text(body: Mapping[str, Any], fallback: str = "failed", *, under: int = 0) -> str:
    """A problem document as one line: its detail, then each field error's path and message.
    ``under`` drops that many leading parts of each path besides ``body`` (a batch item's
    errors sit under ``observers``, INDEX)."""
    detail = body.get("detail") or body.get("title") or fallback
    errors_ = body.get("errors")
    if isinstance(detail, list):  # FastAPI's own validation shape
        errors_, detail = detail, "invalid request"
    if isinstance(errors_, list) and errors_:
        parts = []
        for e in errors_:
            loc = [p for p in e.get("loc", ()) if p != "body"][under:]
            where = ".".join(str(p) for p in loc)
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return f"{detail}: " + "; ".join(parts)
    return str(detail)


def error_for(status: int, data: bytes, reason: str, retry_after: str | None) -> ApiError:
    """The error of an answer with a status of 400 or more."""
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return error_of(status, body, problem_text(body, reason), retry_after)
    return error_of(status, {}, data.decode(errors="replace").strip() or reason, retry_after)


def error_of(
    status: int, problem: Mapping[str, Any], text: str, retry_after: str | None = None
) -> ApiError:
    """The error of a problem document (an answer's, or a batch or action item's)."""
    message = f"{status}: {text}" + (f"; {TOKEN_HINT}" if status == 401 else "")
    cls = _BY_TYPE.get(str(problem.get("type")), _BY_STATUS.get(status, ApiError))
    if cls is Unavailable:
        return Unavailable(message, status, problem, _seconds(retry_after))
    return cls(message, status, problem)


def _seconds(retry_after: str | None) -> float | None:
    try:
        return max(0.0, float(retry_after)) if retry_after else None
    except ValueError:  # an HTTP date: not sent by the manager
        return None


# ------------------------------------------------------------------------------------- models
M = TypeVar("M")


def _value(hint: Any, raw: Any) -> Any:
    """``raw`` (JSON) as the type ``hint`` names: datetimes, UUIDs, models, lists of them."""
    if raw is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value(inner[0], raw) if len(inner) == 1 else raw
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_value(item, r) for r in raw]
    if hint is datetime:
        return datetime.fromisoformat(raw)
    if hint is uuid.UUID:
        return uuid.UUID(raw)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return model(hint, raw)
    return raw


def model(cls: type[M], data: Mapping[str, Any]) -> M:
    """A response model from the API's JSON: its fields only (newer ones are left out), each
    of its type; a field the manager's release lacks takes its default."""
    hints = typing.get_type_hints(cls)
    assert dataclasses.is_dataclass(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: _value(hints[k], v) for k, v in data.items() if k in known})


@dataclasses.dataclass(frozen=True)
class Observer:
    id: uuid.UUID
    name: str
    kind: str
    status: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    service_id: uuid.UUID | None = None
    epoch: int = 0
    checkpoint: Any = None
    checkpointed_at: datetime | None = None
    restart_count: int = 0
    last_error: str | None = None
    traceback: str | None = None
    restart_policy: dict[str, Any] | None = None
    created_at: datetime | None = None
    modified_at: datetime | None = None
    started_at: datetime | None = None
    output_seq: int = 0
    committed_at: datetime | None = None
    #: Why no live service runs it now (queued for a slot, none able to, …); None when one does.
    waiting: str | None = None
    pool: str = "default"
    kind_version: str | None = None


@dataclasses.dataclass(frozen=True)
class ObserverPage:
    items: list[Observer]
    limit: int
    offset: int
    next_offset: int | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    at: datetime
    event: str
    service_id: uuid.UUID | None = None
    service_name: str | None = None
    epoch: int | None = None
    detail: str | None = None


@dataclasses.dataclass(frozen=True)
class Service:
    id: uuid.UUID
    name: str
    worker_count: int
    running: int
    host: str = ""
    pid: int = 0
    version: str = ""
    created_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    lease_expires_at: datetime | None = None
    is_deleted: bool = False
    draining: bool = False
    pool: str = "default"
    kinds: list[str] | None = None
    #: Its resident memory and its share of one core, as its last renewal reported them.
    rss_bytes: int | None = None
    cpu: float | None = None


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    description: str = ""
    params_schema: dict[str, Any] | None = None
    restart_policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    services: list[str] = dataclasses.field(default_factory=list)
    pools: list[str] = dataclasses.field(default_factory=list)
    version: str = "1"
    versions: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str
    services: int
    slots: int
    running: int
    unheld: int
    kinds: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class Totals:
    services: int
    slots: int
    running: int
    free: int
    waiting: int
    by_status: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One observer of a batch or an action: done (``observer``) or not (``error``)."""

    status: int
    observer: Observer | None = None
    error: ApiError | None = None
    #: Its position in a batch create; its id in an action.
    index: int | None = None
    id: uuid.UUID | None = None


@dataclasses.dataclass(frozen=True)
class BatchResult:
    created: int
    failed: int
    items: list[Outcome]


@dataclasses.dataclass(frozen=True)
class ActionResult:
    matched: int
    done: int
    failed: int
    more: bool
    items: list[Outcome]


@dataclasses.dataclass(frozen=True)
class MoveResult:
    matched: int
    moved: int
    more: bool
    ids: list[uuid.UUID]


def _outcomes(items: list[dict[str, Any]]) -> list[Outcome]:
    out = []
    for i in items:
        problem = i.get("problem")
        error = None
        if problem:
            error = error_of(int(i["status"]), problem, problem_text(problem))
        observer = model(Observer, i["observer"]) if i.get("observer") else None
        oid = uuid.UUID(i["id"]) if i.get("id") else None
        out.append(Outcome(int(i["status"]), observer, error, i.get("index"), oid))
    return out


# ------------------------------------------------------------------------------------ requests
@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: dict[str, Any] | None = None
    body: Any = None

    def target(self, root: str) -> str:
        query = urlencode(
            {k: _param(v) for k, v in (self.params or {}).items() if v is not None}, doseq=True
        )
        return root + self.path + (f"?{query}" if query else "")

    @property
    def reads(self) -> bool:
        return self.method == "GET"


def _param(value: Any) -> Any:
    """A query value as the API reads it: booleans as ``true`` and ``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, uuid.UUID) else value


def _ref(observer: str | uuid.UUID | Observer) -> str:
    """The path segment of an observer (its id: a name is looked up first, ``_named``) or of
    a service (its id or name, as the API takes either)."""
    if isinstance(observer, Observer):
        return str(observer.id)
    return quote(str(observer), safe="")


def _is_id(text: str | uuid.UUID) -> bool:
    if isinstance(text, uuid.UUID):
        return True
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _selector(
    ids: list[uuid.UUID | str] | None,
    status: str | None,
    kind: str | None,
    pool: str | None,
    name_prefix: str | None,
) -> dict[str, Any]:
    chosen = {
        "ids": [str(i) for i in ids] if ids is not None else None,
        "status": status,
        "kind": kind,
        "pool": pool,
        "name_prefix": name_prefix,
    }
    return {k: v for k, v in chosen.items() if v is not None}


class _Api:
    """What both clients share: where the manager is, the token, the retry of a 503, and
    every API action as a request and what its answer becomes."""

    def __init__(
        self,
        base_url: str | None,
        token: str | None,
        timeout: float,
        retries: int,
        max_wait: float,
    ) -> None:
        self.base_url = (base_url or os.environ.get("ORCH_API") or DEFAULT_URL).rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ApiError(f"the manager's address is not an http(s) URL: {self.base_url!r}")
        self._url = url
        token = token if token is not None else os.environ.get("ORCH_TOKEN")
        self.headers = {"Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.retries = retries
        self.max_wait = max_wait

    def wait_before(self, attempt: int, exc: Unavailable, request: Request) -> float | None:
        """Seconds to wait before trying ``request`` again after ``exc``, or None: give up.
        Only a read is tried again when nothing came back: a write may have been done."""
        if attempt >= self.retries:
            return None
        if exc.status is None and not request.reads:
            return None
        asked = exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt
        return min(asked, self.max_wait)

    def unreachable(self, exc: BaseException) -> Unavailable:
        reason = str(exc) or type(exc).__name__
        return Unavailable(f"cannot reach the manager at {self.base_url}: {reason}")


#: (The clients have a method named ``list``: these name the builtin where it is shadowed.)
Ids = list[uuid.UUID | str] | None
Items = list[Mapping[str, Any]]


class _Actions:
    """The API's actions, over ``_call(request, then)``: written once for both clients (the
    async client's ``_call`` returns an awaitable, which its methods return)."""

    def _call(self, request: Request, then: Callable[[Any], Any]) -> Any:
        """Send ``request``, and give ``then`` of its JSON (an awaitable, in ``AsyncClient``)."""
        raise NotImplementedError

    # observers ------------------------------------------------------------------------------
    def create(
        self,
        name: str,
        kind: str,
        *,
        params: Mapping[str, Any] | None = None,
        pool: str | None = None,
        version: str | None = None,
        restart_policy: Mapping[str, Any] | None = None,
    ) -> Any:
        """Start an observer (``Observer``); ``NameTaken`` when a live one has that name."""
        body: dict[str, Any] = {"name": name, "kind": kind, "params": dict(params or {})}
        if pool is not None:
            body["pool"] = pool
        if version is not None:
            body["version"] = version
        if restart_policy is not None:
            body["restart_policy"] = dict(restart_policy)
        return self._call(Request("POST", "/observers", body=body), _as(Observer))

    def create_many(self, observers: Items) -> Any:
        """Up to 1,000 in one request (``BatchResult``): each one that fails, fails alone."""
        body = {"observers": [dict(o) for o in observers]}

        def then(j: Any) -> BatchResult:
            return BatchResult(j["created"], j["failed"], _outcomes(j["items"]))

        return self._call(Request("POST", "/observers/batch", body=body), then)

    def get(self, observer: str | uuid.UUID) -> Any:
        """One observer, by id or by name (``Observer``); ``NotFound``."""
        if _is_id(observer):
            return self._call(Request("GET", f"/observers/{_ref(observer)}"), _as(Observer))
        return self._call(
            Request("GET", "/observers", {"name": observer, "include_deleted": False}),
            lambda j: _named(str(observer), j),
        )

    def list(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        pool: str | None = None,
        service_id: uuid.UUID | str | None = None,
        name: str | None = None,
        param: str | None = None,
        include_deleted: bool = False,
        limit: int = 100,
        offset: int = 0,
    ) -> Any:
        """One page (``ObserverPage``), oldest first; its ``next_offset`` is None on the last.
        ``observers()`` goes through every page. ``param``: ``PATH=VALUE``, only observers whose
        params hold that value there (``feed.symbol=BTC``; an admin token's search)."""
        params = {
            "status": status,
            "kind": kind,
            "pool": pool,
            "service_id": service_id,
            "name": name,
            "param": param,
            "include_deleted": include_deleted,
            "limit": limit,
            "offset": offset,
        }
        return self._call(Request("GET", "/observers", params), _as(ObserverPage))

    def events(self, observer: str | uuid.UUID) -> Any:
        """Its history, oldest first (``list[Event]``)."""
        return self._by_id(observer, "GET", "/events", lambda j: [model(Event, e) for e in j])

    def delete(self, observer: str | uuid.UUID) -> Any:
        """End it: ``deleted``, or ``on_deleting`` until its service has stopped it."""
        return self._by_id(observer, "DELETE", "", _as(Observer))

    def pause(self, observer: str | uuid.UUID) -> Any:
        return self._by_id(observer, "POST", "/pause", _as(Observer))

    def resume(self, observer: str | uuid.UUID) -> Any:
        return self._by_id(observer, "POST", "/resume", _as(Observer))

    def restart(self, observer: str | uuid.UUID) -> Any:
        """Revive a failed one, from its last checkpoint, with a fresh restart budget; or
        restart a running one: its copy stops and a new one starts from its last checkpoint."""
        return self._by_id(observer, "POST", "/restart", _as(Observer))

    def edit(self, observer: str | uuid.UUID, params: Mapping[str, Any]) -> Any:
        """New params for a paused or failed one, merged into its own (a key given as None is
        removed) and validated by its kind; its resume or restart starts with them.
        ``Conflict`` while it runs: pause it first."""
        body = {"params": dict(params)}
        return self._by_id(observer, "PATCH", "", _as(Observer), body)

    def act(
        self,
        action: str,
        *,
        ids: Ids = None,
        status: str | None = None,
        kind: str | None = None,
        pool: str | None = None,
        name_prefix: str | None = None,
        limit: int = 1000,
    ) -> Any:
        """``pause``, ``resume``, ``restart`` or ``delete`` every observer a selector takes, in
        one request (``ActionResult``: each one's outcome)."""
        body = {
            "action": action,
            "selector": _selector(ids, status, kind, pool, name_prefix),
            "limit": limit,
        }

        def then(j: Any) -> ActionResult:
            return ActionResult(
                j["matched"], j["done"], j["failed"], j["more"], _outcomes(j["items"])
            )

        return self._call(Request("POST", "/observers/actions", body=body), then)

    def move(
        self,
        *,
        to_pool: str | None = None,
        to_version: str | None = None,
        any_version: bool = False,
        ids: Ids = None,
        status: str | None = None,
        kind: str | None = None,
        pool: str | None = None,
        name_prefix: str | None = None,
        percent: float = 100,
        limit: int = 1000,
    ) -> Any:
        """Move the observers a selector takes to another pool, or pin them to a version
        (``MoveResult``); running ones are handed over gracefully."""
        body: dict[str, Any] = {
            "selector": _selector(ids, status, kind, pool, name_prefix),
            "percent": percent,
            "limit": limit,
            "any_version": any_version,
        }
        if to_pool is not None:
            body["to_pool"] = to_pool
        if to_version is not None:
            body["to_version"] = to_version
        return self._call(Request("POST", "/observers/move", body=body), _as(MoveResult))

    # the cluster ----------------------------------------------------------------------------
    def services(self) -> Any:
        """The live services (``list[Service]``)."""
        return self._call(Request("GET", "/services"), lambda j: [model(Service, s) for s in j])

    def drain(self, service: uuid.UUID | str) -> Any:
        """The service (its id, or the name of the one live service that has it) hands its
        observers over and takes no new ones (``Service``); ``Conflict`` when several live
        services have that name."""
        return self._call(Request("POST", f"/services/{_ref(service)}/drain"), _as(Service))

    def undrain(self, service: uuid.UUID | str) -> Any:
        """Undo a drain (``Service``): the service takes work again."""
        return self._call(Request("POST", f"/services/{_ref(service)}/undrain"), _as(Service))

    def kinds(self) -> Any:
        return self._call(Request("GET", "/kinds"), lambda j: [model(Kind, k) for k in j])

    def pools(self) -> Any:
        return self._call(Request("GET", "/pools"), lambda j: [model(Pool, p) for p in j])

    def totals(self) -> Any:
        """Capacity, used and waiting across the cluster (``Totals``)."""
        return self._call(Request("GET", "/views/totals"), _as(Totals))

    def _by_id(
        self,
        observer: str | uuid.UUID,
        method: str,
        suffix: str,
        then: Callable[[Any], Any],
        body: Any = None,
    ) -> Any:
        if _is_id(observer):
            path = f"/observers/{_ref(observer)}{suffix}"
            return self._call(Request(method, path, body=body), then)
        return self._named_then(str(observer), Request(method, suffix, body=body), then)

    def _named_then(self, name: str, request: Request, then: Callable[[Any], Any]) -> Any:
        """``request`` (its path a suffix) for the live observer of that name."""
        raise NotImplementedError


def _for(found: Observer, request: Request) -> Request:
    """``request``, whose path is a suffix, for that observer."""
    return dataclasses.replace(request, path=f"/observers/{found.id}{request.path}")


def _as(cls: type[M]) -> Callable[[Any], M]:
    return lambda j: model(cls, j)


def _named(name: str, page: Any) -> Observer:
    """The live observer of that name, from a page of those whose name holds it."""
    for o in page["items"]:
        if o["name"] == name:
            return model(Observer, o)
    raise NotFound(f"404: no observer that is not deleted is named {name!r}", 404)


class Client(_Actions):
    """The API, blocking. ``base_url``: else ``ORCH_API``, else ``http://127.0.0.1:8000``;
    ``token``: else ``ORCH_TOKEN``."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30,
        retries: int = 3,
        max_wait: float = 10,
    ) -> None:
        self._api = _Api(base_url, token, timeout, retries, max_wait)
        self.base_url = self._api.base_url

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing is kept open between requests."""

    def _call(self, request: Request, then: Callable[[Any], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return then(self._send(request))
            except Unavailable as exc:
                wait = self._api.wait_before(attempt, exc, request)
                if wait is None:
                    raise
                time.sleep(wait)
                attempt += 1

    def _named_then(self, name: str, request: Request, then: Callable[[Any], Any]) -> Any:
        found: Observer = self.get(name)
        return self._call(_for(found, request), then)

    def _connection(self) -> http.client.HTTPConnection:
        import http.client

        url, timeout = self._api._url, self._api.timeout
        if url.scheme == "http":
            return http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)
        import ssl

        return http.client.HTTPSConnection(
            url.hostname or "", url.port, timeout=timeout, context=ssl.create_default_context()
        )

    def _send(self, request: Request) -> Any:
        import http.client

        headers = {**self._api.headers, "Connection": "close"}
        body = None
        if request.body is not None:
            body = json.dumps(request.body).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        try:
            conn.request(request.method, request.target(self._api._url.path), body, headers)
            r = conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._api.unreachable(exc) from None
        finally:
            conn.close()
        if r.status >= 400:
            raise error_for(r.status, data, r.reason, r.getheader("Retry-After"))
        return json.loads(data) if data else None

    def observers(self, *, page_size: int = 500, **filters: Any) -> Iterator[Observer]:
        """Every observer the filters take (those of ``list``), page after page."""
        offset: int | None = 0
        while offset is not None:
            page: ObserverPage = self.list(limit=page_size, offset=offset, **filters)
            yield from page.items
            offset = page.next_offset

    # The command line's own: an API path, its JSON as it is.
    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                json_: Any = None) -> Any:  # fmt: skip
        return self._call(Request(method, path, params, json_), lambda j: j)

    def get_json(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post_json(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json_=body)

    def wait(
        self, what: str, check: Callable[[], Any], *, timeout: float, every: float = 0.5
    ) -> Any:
        """Poll ``check`` until it returns something truthy; ApiError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise ApiError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(every)


class AsyncClient(_Actions):
    """The API on asyncio (over httpx): the same actions as ``Client``, each awaited;
    ``observers()`` is an async iterator. Close it (``async with``) to close its connections."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30,
        retries: int = 3,
        max_wait: float = 10,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        import httpx

        self._api = _Api(base_url, token, timeout, retries, max_wait)
        self.base_url = self._api.base_url
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._own = http is None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def _call(self, request: Request, then: Callable[[Any], Any]) -> Any:
        import asyncio

        attempt = 0
        while True:
            try:
                return then(await self._send(request))
            except Unavailable as exc:
                wait = self._api.wait_before(attempt, exc, request)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                attempt += 1

    async def _named_then(self, name: str, request: Request, then: Callable[[Any], Any]) -> Any:
        found: Observer = await self.get(name)
        return await self._call(_for(found, request), then)

    async def _send(self, request: Request) -> Any:
        import httpx

        url = self.base_url + request.target("")
        try:
            r = await self._http.request(
                request.method, url, json=request.body, headers=self._api.headers
            )
        except httpx.HTTPError as exc:
            raise self._api.unreachable(exc) from None
        if r.status_code >= 400:
            raise error_for(r.status_code, r.content, r.reason_phrase, r.headers.get("Retry-After"))
        return r.json() if r.content else None

    async def observers(self, *, page_size: int = 500, **filters: Any) -> AsyncIterator[Observer]:
        """Every observer the filters take (those of ``list``), page after page."""
        offset: int | None = 0
        while offset is not None:
            page: ObserverPage = await self.list(limit=page_size, offset=offset, **filters)
            for o in page.items:
                yield o
            offset = page.next_offset
