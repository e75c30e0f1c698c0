"""One error shape for every 4xx and 5xx: RFC 9457 problem details.

``{"type": "about:blank", "title": "Not Found", "status": 404, "detail": "…"}``, served as
``application/problem+json``; a validation error adds ``errors``, one per field, with its path
(``loc``). Nothing a client sent is echoed back, so no input can make an error unencodable.
"""

from __future__ import annotations

import functools
import http
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import compile_path

from orch_contracts.errors import (
    Conflict,
    InvalidInput,
    InvalidParams,
    NameTaken,
    NotFound,
    OrchError,
    TooLarge,
    Transient,
    UnknownKind,
)
from orch_contracts.kinds import RULE_ONLY
from orch_manager.auth import Forbidden, Unauthenticated

log = logging.getLogger(__name__)
MEDIA_TYPE = "application/problem+json"


class FieldError(BaseModel):
    loc: list[str | int] = Field(description="where: body, query or path, then the field path")
    msg: str
    type: str


class Problem(BaseModel):
    """What went wrong (RFC 9457)."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[FieldError] | None = None


_STATUS: list[tuple[type[OrchError], int]] = [
    (Unauthenticated, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (Conflict, 409),
    (TooLarge, 413),
    (InvalidInput, 422),
    (Transient, 503),
]


def _clean(text: object) -> str:
    """A string any encoder takes (a lone surrogate becomes U+FFFD)."""
    return str(text).encode("utf-8", "replace").decode("utf-8")


#: Problem types a client can tell apart where the status alone does not (RFC 9457 ``type``;
#: the others are ``about:blank``): ``orch.client`` raises the error of the same name.
PROBLEM_TYPES: list[tuple[type[OrchError], str]] = [
    (NameTaken, "urn:observer-orchestrator:name-taken"),
    (UnknownKind, "urn:observer-orchestrator:unknown-kind"),
    (InvalidParams, "urn:observer-orchestrator:invalid-params"),
]


def problem_of(
    status: int,
    detail: str,
    *,
    errors: list[dict[str, Any]] | None = None,
    type_: str = "about:blank",
) -> dict[str, Any]:
    """The problem document, as a JSON object (also what a bulk create gives each failed
    item)."""
    body = Problem(
        type=type_,
        title=http.HTTPStatus(status).phrase,
        status=status,
        detail=_clean(detail),
        errors=None if errors is None else [FieldError(**e) for e in errors],
    )
    return body.model_dump(exclude_none=True)


def problem(
    status: int,
    detail: str,
    *,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        problem_of(status, detail, errors=errors), status, headers=headers, media_type=MEDIA_TYPE
    )


def status_of(exc: OrchError) -> int:
    """The HTTP status of one of the orchestrator's errors."""
    return next(c for cls, c in _STATUS if isinstance(exc, cls))


def problem_for(exc: OrchError) -> dict[str, Any]:
    """The problem document of one of the orchestrator's errors: its status, message, type."""
    type_ = next((t for cls, t in PROBLEM_TYPES if isinstance(exc, cls)), "about:blank")
    return problem_of(status_of(exc), str(exc), type_=type_)


def field_errors(errors: Sequence[Any], *, under: Sequence[str | int] = ()) -> list[dict[str, Any]]:
    """Pydantic's errors as FieldError objects, their paths under ``under``: the field and the
    rule, never the value (pydantic's ``input`` and ``ctx`` are left out)."""
    return [
        {
            "loc": [*under, *(p if isinstance(p, int) else _clean(p) for p in e.get("loc", ()))],
            "msg": _clean(RULE_ONLY.get(e.get("type", ""), e.get("msg", "invalid"))),
            "type": _clean(e.get("type", "invalid")),
        }
        for e in errors
    ]


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI: the problem codes a route really returns."""
    return {code: {"model": Problem, "description": http.HTTPStatus(code).phrase} for code in codes}


def openapi_with_problems(app: FastAPI, kinds: list[str] | None) -> dict[str, Any]:
    """The app's OpenAPI, with every 4xx and 5xx documented as ``application/problem+json``
    (FastAPI would say ``application/json``, and its own 422 shape), and ``kind`` as the enum of
    the kinds this cluster runs."""
    from fastapi.openapi.utils import get_openapi

    spec = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    components["FieldError"] = components["Problem"].pop("$defs")["FieldError"]
    for key in ("HTTPValidationError", "ValidationError"):
        components.pop(key, None)
    problem_ref = {"schema": {"$ref": "#/components/schemas/Problem"}}
    for operations in spec["paths"].values():
        for op in operations.values():
            for code, answer in op.get("responses", {}).items():
                if code.isdigit() and int(code) >= 400:
                    answer["content"] = {MEDIA_TYPE: problem_ref}
                    answer["description"] = http.HTTPStatus(int(code)).phrase
    if kinds and "ObserverCreate" in components:
        components["ObserverCreate"]["properties"]["kind"]["enum"] = sorted(kinds)
    return spec


_VERBS = {"get", "put", "post", "delete", "patch", "options"}


@functools.cache
def _pattern(template: str) -> re.Pattern[str]:
    return compile_path(template)[0]


def _methods_of(request: Request) -> list[str]:
    """The methods of the resource at this path, as the OpenAPI documents them. A literal path
    (``/observers/batch``) is its own resource, not an id of the templated one beside it
    (``/observers/{observer_id}``)."""
    path = request.scope["path"]
    paths: dict[str, dict[str, Any]] = request.app.openapi()["paths"]
    matching = [t for t in paths if _pattern(t).match(path)]
    chosen = [t for t in matching if "{" not in t] or matching
    return sorted({verb.upper() for t in chosen for verb in paths[t] if verb in _VERBS})


def install(app: FastAPI) -> None:
    async def orch_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OrchError)
        code = status_of(exc)
        if code == 503:
            log.warning("unavailable: %s", exc)
            return problem(
                503,
                "the database or the broker is unavailable; try again",
                headers={"Retry-After": "1"},
            )
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        return JSONResponse(problem_for(exc), code, headers=headers, media_type=MEDIA_TYPE)

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return problem(422, "the request is not valid", errors=field_errors(exc.errors()))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not just the first route's
            headers["Allow"] = ", ".join(_methods_of(request))
        return problem(exc.status_code, str(exc.detail), headers=headers)

    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return problem(500, "an internal error; the manager's log says more")

    for cls, _code in _STATUS:
        app.add_exception_handler(cls, orch_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crashed)
