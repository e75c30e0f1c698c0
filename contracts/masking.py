"""The one masker: what a secret looks like in text, and ``***`` in its place.

Every route, view, history event, error, log line and command-line message that could quote a
secret passes through ``mask``: the service when it records an observer's error (it knows the
observer's params, so their secret values too), the manager when it shows an error to a
``read`` token, each log handler, the settings' error messages, ``http_poll``'s errors and
httpx's lines. What it hides:

- each of ``secrets``, the values of the secret params of the observer the text is about
  (``orch_contracts.kinds.secret_values``), wherever they stand;
- in every URL, the password, and the user name too unless ``keep_user`` (a user name alone is
  always hidden: it is often a token, ``https://ghp_…@github.com``);
- the values of parameters named like secrets (``is_secret_name``) or in ``names``, after
  ``?``, ``&``, ``;`` or ``#``, in a URL or not (``…?password=…`` of a malformed DSN too).

A secret in a URL's path (``/bot<token>/``) is not recognised unless it is one of ``secrets``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

#: What a secret is replaced with wherever it would be shown.
SECRET = "***"
_SECRET_WORDS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "apikey",
    "api_key",
    "signature",
    "credential",
    "private_key",
    "privatekey",
    "access_key",
    "accesskey",
    "bearer",
    "jwt",
    "cookie",
    "sessionid",
    "session_id",
    "assertion",
)
_SECRET_NAMES = frozenset({"key", "pass", "pwd", "sig", "auth", "authorization", "session"})


def is_secret_name(name: str) -> bool:
    """Whether a query parameter (or a param) of this name holds a secret: ``api_key``,
    ``token``, ``password``, ``secret``, ``key``, ``signature``, ``X-Amz-Credential``, any
    ``…_key``, ``…_token`` and the like."""
    n = name.strip().lower().replace("-", "_")
    return n in _SECRET_NAMES or n.endswith("_key") or any(w in n for w in _SECRET_WORDS)


#: A URL in a line of text (up to whitespace or a quote).
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s<>\"'`]+", re.I)
#: ``scheme://user:password@`` anywhere (a URL inside another one's query too): the password.
_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@", re.I)
#: ``scheme://anything@`` anywhere: user and password.
_USERINFO = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://)[^\s/@?#\"'<>]+@", re.I)
#: ``?name=value`` (or after ``&``, ``;``, ``#``) anywhere in the text.
_PAIR = re.compile(r"(?P<head>[?&;#](?P<name>[^=&;#?\s\"'<>]+)=)(?P<value>[^&;#\s\"'<>]+)")


def mask(
    text: str, *, secrets: Iterable[str] = (), names: Iterable[str] = (), keep_user: bool = True
) -> str:
    """``text`` as it may be shown anywhere: see the module's docstring. ``secrets`` longest
    first (``orch_contracts.kinds.secret_values`` gives them so), ``names`` compared without
    case."""
    for value in secrets:
        if value:
            text = text.replace(value, SECRET)
    if "://" in text:  # every log line passes here: most have no URL at all
        userinfo = _PASSWORD if keep_user else _USERINFO
        text = userinfo.sub(lambda m: f"{m['head']}{SECRET}@", text)
        text = _URL.sub(lambda m: _mask_authority(m.group(), keep_user), text)
    if "=" in text:
        wanted = frozenset(n.lower() for n in names)

        def pair(m: re.Match[str]) -> str:
            name = urllib.parse.unquote_plus(m["name"])
            if is_secret_name(name) or name.lower() in wanted:
                return f"{m['head']}{SECRET}"
            return m.group()

        text = _PAIR.sub(pair, text)
    return text


def _mask_authority(url: str, keep_user: bool) -> str:
    """``url`` with its password (and, unless ``keep_user``, its user name) as ``***``; a user
    name without a password is masked even with ``keep_user``. Split as a URL is (the last
    ``@`` of the authority ends the user info), which the patterns above cannot do."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" not in authority:
        return url
    userinfo, host = authority.rsplit("@", 1)
    user, colon, _password = userinfo.partition(":")
    shown = f"{user}:{SECRET}" if keep_user and colon and user != SECRET else SECRET
    return f"{scheme}://{shown}@{host}{tail}"
