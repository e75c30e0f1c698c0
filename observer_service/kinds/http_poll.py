"""``http_poll``: GETs a URL every ``interval`` seconds and checkpoints what changed and when.

Safe by default: it reads at most ``max_bytes`` of a body, follows at most ``max_redirects``
redirects, gives up after ``timeout``, and connects only where the egress policy allows
(``observer_service.egress``): public addresses on ports 80 and 443, or what
``ORCH_HTTP_POLL_ALLOW`` opens (``example.com``, ``*.example.org``, ``api.example.com:8443``,
``10.0.0.0/8:443``), checked on the address actually connected to, redirects included.

URL credentials and the values of secret query parameters
(``orch_contracts.masking.is_secret_name``, plus the observer's own ``secret_query``) never reach
a log line or ``last_error``.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time

import httpx
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from observer_service import egress
from observer_service.context import ObserverContext
from observer_service.egress import EgressPolicy, EgressRefused
from orch_contracts.kinds import RestartPolicy, from_client, observer_kind
from orch_contracts.masking import mask


class HttpPollSettings(BaseSettings):
    """This kind's own settings (the same in the manager, which validates, and the services)."""

    model_config = SettingsConfigDict(env_prefix="ORCH_HTTP_POLL_", extra="ignore")

    #: Comma-separated ``HOST[:PORT]`` entries it may connect to (``observer_service.egress``):
    #: ``example.com``, ``*.example.com`` (and subdomains), ``*``, ``192.0.2.1``,
    #: ``10.0.0.0/8``, ``[fd00::/8]``; ``:PORT`` a number or ``*``, without it 80 and 443.
    #: Empty: any host on 80 and 443, public addresses only.
    allow: str = ""

    @field_validator("allow")
    @classmethod
    def _parses(cls, allow: str) -> str:
        EgressPolicy.parse(allow)
        return allow

    def policy(self) -> EgressPolicy:
        return EgressPolicy.parse(self.allow)

    def allows(self, host: str, port: int = 443) -> bool:
        """What can be told without resolving ``host``: may a request to it be sent."""
        try:
            self.policy().check(host, port)
        except EgressRefused:
            return False
        return True


#: A request the egress policy refuses (kept under its old name).
NotAllowed = EgressRefused

#: A create's refusal: the rule and what opens it, never the client's host echoed.
REFUSED_AT_CREATE = (
    f"{egress.REFUSED} (its host or its port): ORCH_HTTP_POLL_ALLOW, set alike for the manager "
    "and the services, says what may be reached (by default public addresses, ports 80 and 443)"
)


class BodyTooLarge(Exception):
    pass


class PollFailed(Exception):
    """An error whose text named a secret, with the secret masked."""


class PollTimedOut(TimeoutError):
    """No complete answer within the poll's ``timeout`` (however slowly the server trickled)."""


class HttpPollParams(BaseModel):
    # The URL may carry secrets: a validation error never shows it.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    url: AnyHttpUrl
    interval: float = Field(default=30.0, ge=0.1, le=86_400)
    timeout: float = Field(default=10.0, gt=0, le=300)
    max_bytes: int = Field(default=1 << 20, ge=1, le=64 << 20, description="body read at most")
    max_redirects: int = Field(default=5, ge=0, le=20)
    secret_query: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="more query parameters whose values are masked in logs and errors",
    )

    @field_validator("url")
    @classmethod
    def _allowed(cls, url: AnyHttpUrl, info: ValidationInfo) -> AnyHttpUrl:
        # What can be told now; the address is checked at every connection.
        try:
            HttpPollSettings().policy().check(url.host or "", url.port or 0)
        except EgressRefused as exc:
            if from_client(info):  # the rule, not the host: a client's input is not echoed
                raise ValueError(REFUSED_AT_CREATE) from None
            raise ValueError(str(exc)) from None  # the observer's own error: where it went
        return url


# ------------------------------------------------------------------------- masking
#: The secret query names of the request being made in this task (for httpx's log lines).
_declared: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "http_poll_secret_query", default=()
)


class _MaskSecrets(logging.Filter):
    """httpx logs every request's URL (httpcore, at DEBUG, the headers): masked before any
    handler sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask(message, names=_declared.get(), keep_user=False)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def _install_filter() -> None:
    # A logger's filters see only its own records: httpx's, and httpcore's (DEBUG: headers).
    for name in ("httpx", "httpcore.connection", "httpcore.http11", "httpcore.http2"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _MaskSecrets) for f in logger.filters):
            logger.addFilter(_MaskSecrets())


_install_filter()
HttpPollSettings()  # a bad ORCH_HTTP_POLL_ALLOW stops the process at start


# ------------------------------------------------------------------------- polling
async def fetch(client: httpx.AsyncClient, p: HttpPollParams) -> tuple[int, str]:
    """(status code, SHA-256 of the body), reading at most ``max_bytes`` of it."""
    token = _declared.set(tuple(p.secret_query))
    try:
        digest = hashlib.sha256()
        size = 0
        # The whole poll within the timeout (httpx's applies to each read), and the body as it
        # came over the wire: never decompressed, so a small compressed body cannot grow past
        # max_bytes in memory (identity is asked for; a server that compresses anyway is
        # hashed as sent).
        async with asyncio.timeout(p.timeout):
            headers = {"Accept-Encoding": "identity"}
            async with client.stream("GET", str(p.url), headers=headers) as response:
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > p.max_bytes:
                        raise BodyTooLarge(f"the body is larger than {p.max_bytes} bytes")
                    digest.update(chunk)
                return response.status_code, digest.hexdigest()
    except (EgressRefused, BodyTooLarge):
        raise
    except TimeoutError as exc:
        if isinstance(exc, httpx.TimeoutException):
            raise
        raise PollTimedOut(f"no complete answer within {p.timeout:g} s") from None
    except Exception as exc:
        text = str(exc)
        masked = mask(text, names=p.secret_query, keep_user=False)
        if masked != text:
            raise PollFailed(f"{type(exc).__name__}: {masked}") from None
        raise
    finally:
        _declared.reset(token)


def client_for(p: HttpPollParams) -> httpx.AsyncClient:
    """A client under the egress policy of ``ORCH_HTTP_POLL_ALLOW``, read now."""
    return egress.client(
        HttpPollSettings().policy(),
        timeout=p.timeout,
        follow_redirects=True,
        max_redirects=p.max_redirects,
    )


@observer_kind("http_poll", params=HttpPollParams, restart=RestartPolicy(max_restarts=10))
async def http_poll(ctx: ObserverContext) -> None:
    """Polls a URL; checkpoints status code, content hash and the time of the last change."""
    params: HttpPollParams = ctx.params
    state = dict(ctx.last_checkpoint or {})
    async with client_for(params) as client:
        while True:
            status, digest = await fetch(client, params)
            if (state.get("status"), state.get("hash")) != (status, digest):
                state = {"status": status, "hash": digest, "changed_at": time.time()}
                await ctx.checkpoint(state)
            await ctx.sleep(params.interval)
