"""Who may call the API: bearer tokens, each with a name and a role, kept only as SHA-256
digests (``ORCH_API_TOKENS``). ``read`` may look; ``admin`` may also change things.

A request without a valid token gets 401, one whose token lacks the role gets 403. Tokens are
compared in constant time, and what a request did is logged with the token's name, never with
the token. ``/healthz``, ``/readyz``, ``/metrics`` (``ORCH_METRICS_AUTH``) and the console's own
files stay open; the console asks for a token and sends it as a bearer header (no cookie, so no
CSRF). A request with a body is checked once before its body is read
(``orch_manager.http.TokenFirst``) and again, with its role, by its route.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request, params
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orch_contracts.errors import OrchError


class Role(StrEnum):
    READ = "read"
    ADMIN = "admin"


class Unauthenticated(OrchError):
    """No token, or not one we know (401)."""


class Forbidden(OrchError):
    """A known token without the role the request needs (403)."""


@dataclass(frozen=True)
class Token:
    name: str
    role: Role
    digest: bytes

    def allows(self, role: Role) -> bool:
        return self.role is Role.ADMIN or role is Role.READ


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token(name: str, role: Role) -> tuple[str, str]:
    """A fresh random token and its ``ORCH_API_TOKENS`` entry (which holds only its digest)."""
    token = secrets.token_urlsafe(32)
    return token, f"{name}:{role.value}:{digest(token).hex()}"


def parse_tokens(spec: str) -> list[Token]:
    """``name:role:sha256hex`` entries separated by commas or newlines; ``@path`` (or a path
    to an existing file) reads them from that file, where ``#`` starts a comment."""
    spec = spec.strip()
    if spec.startswith("@") or (spec and "/" in spec and Path(spec).is_file()):
        spec = Path(spec.removeprefix("@")).read_text()
    tokens: list[Token] = []
    for raw in spec.replace(",", "\n").splitlines():
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3:
            raise ValueError(f"a token entry is name:role:sha256-hex, got {parts[0]!r}:…")
        name, role, hexdigest = parts
        if role not in Role.__members__.values():
            raise ValueError(f"token {name!r}: role must be read or admin, got {role!r}")
        try:
            raw_digest = bytes.fromhex(hexdigest)
        except ValueError:
            raw_digest = b""
        if len(raw_digest) != 32:
            raise ValueError(f"token {name!r}: the third part must be a SHA-256 digest in hex")
        tokens.append(Token(name, Role(role), raw_digest))
    return tokens


class Authenticator:
    def __init__(self, tokens: list[Token], *, enabled: bool) -> None:
        self.tokens = tokens
        self.enabled = enabled

    def identify(self, presented: str | None) -> Token | None:
        """The token presented, compared with every known one in constant time."""
        if presented is None:
            return None
        candidate = digest(presented)
        found = None
        for token in self.tokens:  # no early exit: the time does not tell which one matched
            if hmac.compare_digest(candidate, token.digest):
                found = token
        return found


#: The name of the API token whose request is being served (None: none, or the API runs without
#: tokens). Set by the route's role check; history rows record it (``repository.record_events``).
ACTOR: ContextVar[str | None] = ContextVar("orch_actor", default=None)

_bearer = HTTPBearer(auto_error=False, description="An API token (ORCH_API_TOKENS)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def requires(role: Role) -> params.Depends:
    """A route dependency: the request's token must have ``role``."""

    async def check(request: Request, credentials: Credentials) -> None:
        auth: Authenticator = request.app.state.auth
        if not auth.enabled:
            request.state.who = "anonymous"
            return
        token = auth.identify(credentials.credentials if credentials else None)
        if token is None:
            raise Unauthenticated("a valid API token is needed (Authorization: Bearer …)")
        request.state.who = token.name
        ACTOR.set(token.name)
        if not token.allows(role):
            raise Forbidden(f"token {token.name!r} has the {token.role} role; this needs {role}")

    dependency: params.Depends = Depends(check)
    return dependency


READ = requires(Role.READ)
ADMIN = requires(Role.ADMIN)
