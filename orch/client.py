"""The API as the command line uses it: one request, its JSON, or a readable failure."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import http.client

#: What a 401 adds: where the command line takes its token from.
TOKEN_HINT = (
    "give an API token with --token TOKEN or the ORCH_TOKEN environment variable "
    "(`orch token new NAME --role admin` makes one; `orch up` prints one for its run)"
)


class ApiError(Exception):
    """A request that failed: its message is the API's own, or why the API was not reached."""


class Client:
    """One connection a request, over the standard library's ``http.client``: a command makes a
    few requests, and its start is what a user waits for (httpx took 0.15 s to import)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30) -> None:
        from urllib.parse import urlsplit

        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ApiError(f"the manager's address is not an http(s) URL: {base_url!r}")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port
        self._root = url.path
        self._timeout = timeout
        self._headers = {"Accept": "application/json", "Connection": "close"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def _connection(self) -> http.client.HTTPConnection:
        import http.client

        if not self._https:
            return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        import ssl

        context = ssl.create_default_context()
        return http.client.HTTPSConnection(
            self._host, self._port, timeout=self._timeout, context=context
        )

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json_: Any = None
    ) -> Any:
        import http.client
        from urllib.parse import urlencode

        query = urlencode({k: _param(v) for k, v in (params or {}).items()}, doseq=True)
        target = self._root + path + (f"?{query}" if query else "")
        headers = dict(self._headers)
        body = None
        if json_ is not None:
            body = json.dumps(json_).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        try:
            conn.request(method, target, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException) as exc:
            reason = str(exc) or type(exc).__name__
            raise ApiError(f"cannot reach the manager at {self.base_url}: {reason}") from None
        finally:
            conn.close()
        if r.status >= 400:
            message = f"{r.status}: {_message(data, r.reason)}"
            if r.status == 401:
                message += f"; {TOKEN_HINT}"
            raise ApiError(message)
        return json.loads(data) if data else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json_=body)

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


def _param(value: Any) -> Any:
    """A query value as the API reads it: booleans as ``true`` and ``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _message(data: bytes, reason: str) -> str:
    """The API's own words: its problem detail, with the fields of a validation error."""
    try:
        body = json.loads(data)
    except ValueError:
        return data.decode(errors="replace").strip() or reason
    if not isinstance(body, dict):
        return str(body)
    return problem_text(body, reason)


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
