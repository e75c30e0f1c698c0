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
from typing import Any, Literal

from pythonjsonlogger.json import JsonFormatter

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
    return _CREDENTIALS.sub(r"\g<head>***@", text)


class _Masked(logging.Formatter):
    """Formats with another formatter, then masks credentials in URLs."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return mask(self.inner.format(record))


class _Text(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [
            f"{key}={getattr(record, key)}"
            for key in (*OBSERVER_FIELDS, *_PROCESS)
            if getattr(record, key, None) is not None
        ]
        return f"{line} [{' '.join(fields)}]" if fields else line


def configure(level: str = "INFO", fmt: LogFormat = "text", **process: object) -> None:
    """Configure the root logger for this process; ``process`` fields go on every line."""
    _PROCESS.clear()
    _PROCESS.update({k: str(v) for k, v in process.items() if v is not None})
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ProcessFields())
    inner: logging.Formatter = (
        JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
        if fmt == "json"
        else _Text()
    )
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
