"""Logs that name what they are about.

Every line carries the process's own fields (which service, or which manager replica); every
line about an observer also carries its id, name, kind and epoch (``observer_log``). Two
formats: ``text`` for people (the fields in brackets at the end of the line) and ``json`` for
log shippers (one object a line). Standard-library logging with a context filter; nothing is
built by string concatenation.
"""

from __future__ import annotations

import logging
import re
import sys
import urllib.parse
import uuid
from collections.abc import Iterable
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

#: The fields a line about an observer carries, in the order the text format shows them.
OBSERVER_FIELDS = ("observer_id", "observer", "kind", "epoch")
_PROCESS: dict[str, str] = {}


class _ProcessFields(logging.Filter):
    """Adds the process's own fields (service id and name, or the manager replica)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _PROCESS.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


#: ``scheme://user:password@`` anywhere in a line: the password is never written.
_CREDENTIALS = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@", re.I)


def mask(text: str) -> str:
    """``text`` with the passwords and the secret query values of its URLs masked."""
    if "://" not in text:  # every log line passes here: most have no URL at all
        return text
    return mask_urls(_CREDENTIALS.sub(r"\g<head>***@", text))


#: Characters that steer a terminal or reorder text rather than show: C0 controls and DEL, C1
#: controls (U+0080-U+009F), and the bidi controls (marks, embeddings, overrides, isolates).
#: As the inside of a regex character class (the API's name pattern uses it too).
UNSAFE_CLASS = r"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
UNSAFE_CHARS = re.compile(f"[{UNSAFE_CLASS}]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def safe_text(s: str) -> str:
    """``s`` with every control and bidi character shown as a visible escape (ESC becomes the
    four characters ``\\x1b``, U+202E the six characters ``\\u202e``), so printing it to a
    terminal or a text log cannot move the cursor, colour the screen, forge a line or reorder
    it. Other text, backslashes included, is unchanged."""
    return UNSAFE_CHARS.sub(_escape_char, s)


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


def _mask_pairs(part: str, names: frozenset[str]) -> str:
    """``a=1&token=x`` → ``a=1&token=***`` (pairs separated by ``&`` or ``;``)."""
    pieces = _PAIR_SEPARATOR.split(part)
    for i in range(0, len(pieces), 2):  # pairs at even places, their separators between
        name, eq, value = pieces[i].partition("=")
        plain = urllib.parse.unquote_plus(name)
        if eq and value and (is_secret_name(plain) or plain.lower() in names):
            pieces[i] = f"{name}{eq}{SECRET}"
    return "".join(pieces)


_PAIR_SEPARATOR = re.compile(r"([&;])")


def mask_url(url: str, *, keep_user: bool = True, names: Iterable[str] = ()) -> str:
    """``url`` with its password (and, unless ``keep_user``, its user name too) and the values
    of secret query (and fragment) parameters replaced by ``***``: those named like secrets
    (``is_secret_name``) and those in ``names``. A user name without a password is masked
    even with ``keep_user``: alone, it is often a token (``https://ghp_…@github.com``)."""
    secret = frozenset(n.lower() for n in names)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, colon, _password = userinfo.partition(":")
        userinfo = f"{user}:{SECRET}" if keep_user and colon else SECRET
        authority = f"{userinfo}@{host}"
    before, hash_, fragment = tail.partition("#")
    path, question, query = before.partition("?")
    if query:
        query = _mask_pairs(query, secret)
    if "=" in fragment:
        fragment = _mask_pairs(fragment, secret)
    return f"{scheme}://{authority}{path}{question}{query}{hash_}{fragment}"


def mask_urls(text: str, *, keep_user: bool = True, names: Iterable[str] = ()) -> str:
    """Every URL in ``text`` masked as ``mask_url`` does."""
    if "://" not in text:
        return text
    names = tuple(names)
    return _URL.sub(lambda m: mask_url(m.group(), keep_user=keep_user, names=names), text)


class _Masked(logging.Formatter):
    """Formats with another formatter, then masks credentials in URLs."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return mask(self.inner.format(record))


class _Text(logging.Formatter):
    """For people: control and bidi characters in what it prints (the message, the observer's
    fields, a traceback's lines) are shown as escapes (``safe_text``), so a name or an error
    string can neither steer the terminal nor forge a line."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        # A copy: the record goes on to other handlers as it came.
        clean = logging.makeLogRecord(record.__dict__)
        clean.msg, clean.args = safe_text(record.getMessage()), None
        if clean.exc_info:
            clean.exc_text = None  # formatted anew, by formatException below
        elif clean.exc_text:
            clean.exc_text = _safe_lines(clean.exc_text)
        line = super().format(clean)
        fields = [
            f"{key}={safe_text(str(getattr(record, key)))}"
            for key in (*OBSERVER_FIELDS, *_PROCESS)
            if getattr(record, key, None) is not None
        ]
        return f"{line} [{' '.join(fields)}]" if fields else line

    def formatException(self, ei: Any) -> str:
        return _safe_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _safe_lines(super().formatStack(stack_info))


#: What every LogRecord carries: anything else on a record came as ``extra`` and is a field.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class _Json(logging.Formatter):
    """For log shippers: one JSON object a line (``time``, ``level``, ``logger``, ``message``,
    then every ``extra`` field: the observer's, the process's), serialised by orjson."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                line[key] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def _safe_lines(text: str) -> str:
    """A traceback keeps its lines; whatever else is in them is escaped."""
    return "\n".join(safe_text(line) for line in text.split("\n"))


def configure(level: str = "INFO", fmt: LogFormat = "text", **process: object) -> None:
    """Configure the root logger for this process; ``process`` fields go on every line."""
    _PROCESS.clear()
    _PROCESS.update({k: str(v) for k, v in process.items() if v is not None})
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ProcessFields())
    inner: logging.Formatter = _Json() if fmt == "json" else _Text()
    handler.setFormatter(_Masked(inner))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # Its pool logs a traceback for every failed reconnect; ours says the database is down.
    logging.getLogger("asyncpg.pool").setLevel(logging.ERROR)


def observer_log(
    logger: logging.Logger | str,
    *,
    observer_id: uuid.UUID,
    name: str | None = None,
    kind: str | None = None,
    epoch: int | None = None,
) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose every line names the observer (and the copy, by its epoch)."""
    base = logging.getLogger(logger) if isinstance(logger, str) else logger
    extra: dict[str, Any] = {"observer_id": str(observer_id), "observer": name, "kind": kind}
    if epoch is not None:
        extra["epoch"] = epoch
    return logging.LoggerAdapter(base, extra)
