"""The API as the command line uses it: one request, its JSON, or a readable failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

#: What a 401 adds: where the command line takes its token from.
TOKEN_HINT = (
    "give an API token with --token TOKEN or the ORCH_TOKEN environment variable "
    "(`orch token new NAME --role admin` makes one; `orch up` prints one for its run)"
)


class ApiError(Exception):
    """A request that failed: its message is the API's own, or why the API was not reached."""


class Client:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30) -> None:
        import httpx  # when a request is made: `orch --version` needs none

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the manager at {self.base_url}: {exc}") from None
        if r.status_code >= 400:
            message = f"{r.status_code}: {_message(r)}"
            if r.status_code == 401:
                message += f"; {TOKEN_HINT}"
            raise ApiError(message)
        return r.json() if r.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

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


def _message(r: httpx.Response) -> str:
    """The API's own words: its problem detail, with the fields of a validation error."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip() or r.reason_phrase
    if not isinstance(body, dict):
        return str(body)
    return problem_text(body, r.reason_phrase)


def problem_text(body: dict[str, Any], fallback: str = "failed", *, under: int = 0) -> str:
    """A problem document as one line: its detail, then each field error's path and message.
    ``under`` drops that many leading parts of each path besides ``body`` (a batch item's
    errors sit under ``observers``, INDEX)."""
    detail = body.get("detail") or body.get("title") or fallback
    errors = body.get("errors")
    if isinstance(detail, list):  # FastAPI's own validation shape
        errors, detail = detail, "invalid request"
    if isinstance(errors, list) and errors:
        parts = []
        for e in errors:
            loc = [p for p in e.get("loc", ()) if p != "body"][under:]
            where = ".".join(str(p) for p in loc)
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return f"{detail}: " + "; ".join(parts)
    return str(detail)
