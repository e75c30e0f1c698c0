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
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson

from orch_contracts.masking import mask

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


#: Characters that steer a terminal or reorder text rather than show: C0 controls and DEL, C1
#: controls (U+0080-U+009F), and the bidi controls (marks, embeddings, overrides, isolates).
#: As the inside of a regex character class. (Names refuse more: ``orch_contracts.names``.)
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


class _Masked(logging.Formatter):
    """Formats with another formatter, then masks what looks like a secret (``masking``)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return mask(self.inner.format(record))


class _Text(logging.Formatter):
    """For people: control and bidi characters in what it prints (the message, the observer's
    fields, a traceback's lines) are shown as escapes (``safe_text``), so a name or an error
    string can neither steer the terminal nor forge a line; a field's value that is not one
    plain word is quoted (``_field``), so a name cannot forge a field either."""

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
            f"{key}={_field(str(getattr(record, key)))}"
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


#: A field value that could end the field or the brackets, or start another field.
_NEEDS_QUOTES = re.compile(rf'[\s\[\]="\\{UNSAFE_CLASS}]|^$')


def _field(value: str) -> str:
    """A field's value as the text format writes it: as it is when it is one plain word, else
    in double quotes with ``\\`` and ``"`` escaped (as logfmt does), then ``safe_text``. So a
    name such as ``x] [observer_id=…`` stays inside its own field: whatever a user chose
    (a name) cannot forge another field or end the brackets."""
    if _NEEDS_QUOTES.search(value) is None:
        return safe_text(value)
    return safe_text('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')


def _safe_lines(text: str) -> str:
    """A traceback keeps its lines; whatever else is in them is escaped."""
    return "\n".join(safe_text(line) for line in text.split("\n"))


def configure(level: str = "INFO", fmt: LogFormat = "text", **process: object) -> None:
    """Configure the root logger for this process; ``process`` fields go on every line."""
    _PROCESS.clear()
    _PROCESS.update({k: str(v) for k, v in process.items() if v is not None})
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ProcessFields())
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_levels(level)


def formatter(fmt: LogFormat = "text") -> logging.Formatter:
    """How a line of this project looks in ``fmt``, secrets masked."""
    return _Masked(_Json() if fmt == "json" else _Text())


def set_levels(level: str) -> None:
    """The root logger at ``level``; the libraries that say too much, at WARNING at least."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    # httpx logs a line per request at INFO: an ``http_poll`` observer's every poll.
    for noisy in ("aiormq", "aio_pika", "httpx", "httpcore"):
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
    secrets: Sequence[str] = (),
) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose every line names the observer (and the copy, by its epoch). With
    ``secrets`` (its secret params' values), none of them is written, whoever logs them."""
    base = logging.getLogger(logger) if isinstance(logger, str) else logger
    extra: dict[str, Any] = {"observer_id": str(observer_id), "observer": name, "kind": kind}
    if epoch is not None:
        extra["epoch"] = epoch
    if secrets:
        return _Hiding(base, extra, tuple(secrets))
    return logging.LoggerAdapter(base, extra)


class _Hiding(logging.LoggerAdapter[logging.Logger]):
    """An observer's logger that writes its message with the observer's secrets masked (the
    handlers' own masking knows no observer's values)."""

    def __init__(self, logger: logging.Logger, extra: dict[str, Any], secrets: tuple[str, ...]):
        super().__init__(logger, extra)
        self.secrets = secrets

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        # As ``LogRecord.getMessage`` formats it (one mapping: named fields).
        one = len(args) == 1 and isinstance(args[0], Mapping) and args[0]
        text = str(msg) % (args[0] if one else args) if args else str(msg)
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # the caller, not this frame
        super().log(level, mask(text, secrets=self.secrets), **kwargs)
