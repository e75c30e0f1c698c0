"""The orchestrator's one error tree, and the edges that convert driver errors into it.

::

    OrchError
    ├── Transient                 retry: a server we need is unavailable for now
    │   ├── DatabaseUnavailable
    │   │   └── RowLocked         a row the write needs is locked by another transaction
    │   └── BrokerUnavailable
    ├── BrokerRefused             the broker refuses what we asked (403, 406, 530): no retry helps
    ├── Conflict                  409: the request contradicts the current state
    │   └── NameTaken
    ├── NotFound                  404
    ├── InvalidInput              422: the client's data cannot be accepted
    │   ├── TooLarge              413
    │   ├── UnknownKind
    │   └── InvalidParams
    ├── AdvertRefused             a service's advert of a kind cannot be read: left out
    └── StartupError              a process cannot start (one readable line)

    BaseException (outside the tree: what kind code may see)
    ├── Fenced                    a write carried a stale epoch: another copy holds the observer
    └── LeaseLost                 this service's lease is no longer surely valid

Driver errors (asyncpg, SQLAlchemy, aio-pika, sockets) are converted where they enter our code
(``database_errors``, ``broker_errors``), so loops decide "retry or stop" on these classes only.
``Fenced`` and ``LeaseLost`` are BaseExceptions so that a kind's ``except Exception`` cannot
swallow them and no restart policy retries them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

# The drivers are imported where their errors are converted: the tree itself is also what the
# API client raises (``orch.client``), in programs that have no driver to load.

#: The name of the unique index that keeps live observer names unique.
LIVE_NAME_INDEX = "uq_observers_live_name"
#: … and the one that keeps names that look alike from living side by side.
LIVE_NAME_KEY_INDEX = "uq_observers_live_name_key"


class OrchError(Exception):
    """Base of every error the orchestrator raises on purpose."""


class Transient(OrchError):
    """A server the orchestrator needs is unavailable for now; the operation may be retried."""


class DatabaseUnavailable(Transient):
    pass


class RowLocked(DatabaseUnavailable):
    """A row the write needs is locked by another transaction (SQLSTATE 55P03, or a batch that
    skipped it): not written and not fenced either, so it is retried like an outage."""


class BrokerUnavailable(Transient):
    pass


class NotLeading(Transient):
    """A leader's transaction found the lease no longer its own: it wrote nothing (its loops
    are about to stop)."""


class Unroutable(BrokerUnavailable):
    """The broker returned a mandatory publish: the queue it names is gone (for now), or, for
    a pool nobody declared yet, not there yet; ``pool``: whose work queue it was."""

    def __init__(self, message: str, pool: str | None = None) -> None:
        super().__init__(message)
        self.pool = pool


class BrokerRefused(OrchError):
    """The broker answered no (access refused, a precondition failed): the same request again
    gets the same answer, so it is not Transient; ``reply_code`` says which no."""

    def __init__(self, message: str, reply_code: int | None = None) -> None:
        super().__init__(message)
        self.reply_code = reply_code


class Conflict(OrchError):
    pass


class NameTaken(Conflict):
    """Detected from the unique index's name, never from the error's text."""

    def __init__(
        self, name: str | None = None, *, observer_id: Any = None, alike: bool = False
    ) -> None:
        """``name``: the existing observer's (never the one asked for, unless they are the
        same); ``alike``: the name asked for differs but looks like it."""
        what = f"named {name!r} " if name is not None else "with that name "
        which = f"(id {observer_id}) " if observer_id is not None else ""
        why = "; names that look alike count as one name" if alike else ""
        super().__init__(f"an observer {what}{which}already exists (and is not deleted){why}")
        self.name = name


class NotFound(OrchError):
    pass


class InvalidInput(OrchError):
    pass


class TooLarge(InvalidInput):
    """Part of the request is over its size limit (413)."""


class AdvertRefused(OrchError):
    """A service's advert of a kind is not one the manager reads (too large or deep, a schema
    that would fetch, a pattern no linear-time engine takes …): that advert is left out."""


class UnknownKind(InvalidInput):
    pass


class InvalidParams(InvalidInput):
    pass


class StartupError(OrchError):
    pass


class Fenced(BaseException):
    """A write carried a stale epoch: another service has taken this observer. Stop at once."""


class LeaseLost(BaseException):
    """This service's lease is no longer surely valid: it must assume others took its observers."""


# SQLSTATE classes: https://www.postgresql.org/docs/current/errcodes-appendix.html
# 25P03: the server ended a session idle in a transaction too long (a leader's fence sets it).
_TRANSIENT_STATES = ("08", "53", "57P", "40001", "40P01", "57014", "25P03")
_LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout, NOWAIT
_INPUT_STATES = ("22", "54")


def _sqlstate(exc: BaseException) -> str:
    return str(getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None) or "")


def convert_database_error(exc: BaseException) -> BaseException:
    """Our error for a driver error, or ``exc`` itself when it is a bug (bad SQL, …)."""
    import asyncpg
    from sqlalchemy import exc as sa

    if isinstance(exc, OrchError):
        return exc
    if isinstance(exc, sa.DBAPIError):
        if exc.connection_invalidated:
            return DatabaseUnavailable(str(exc.orig))
        cause = exc.orig.__cause__ if exc.orig is not None else None
        return convert_database_error(cause if cause is not None else exc.orig or exc)
    if isinstance(exc, sa.TimeoutError):  # the pool: no connection came free in time
        return DatabaseUnavailable(str(exc))
    state = _sqlstate(exc)
    if state == "23505":
        constraint = getattr(exc, "constraint_name", None)
        if constraint in (LIVE_NAME_INDEX, LIVE_NAME_KEY_INDEX):
            return NameTaken()
        return Conflict(_first_line(exc))
    if state.startswith(_INPUT_STATES):
        return InvalidInput(_first_line(exc))
    if state == _LOCK_NOT_AVAILABLE:
        return RowLocked(_first_line(exc))
    if state.startswith(_TRANSIENT_STATES):
        return DatabaseUnavailable(_first_line(exc))
    if isinstance(
        exc,
        asyncpg.InterfaceError
        | asyncpg.exceptions.InternalClientError
        | OSError
        | TimeoutError
        | sa.InterfaceError
        | sa.OperationalError,
    ):
        return DatabaseUnavailable(_first_line(exc) or type(exc).__name__)
    return exc


# AMQP reply codes that no retry changes: ACCESS_REFUSED, PRECONDITION_FAILED, NOT_ALLOWED.
_REFUSED_CODES = frozenset({403, 406, 530})


@functools.cache
def _code_of_class() -> tuple[tuple[type[BaseException], int], ...]:
    """The classes aiormq raises for the reply codes it knows (with only the text as argument)."""
    import aiormq.exceptions

    return (
        (aiormq.exceptions.ChannelAccessRefused, 403),
        (aiormq.exceptions.ProbableAuthenticationError, 403),  # Connection.Close 403 at login
        (aiormq.exceptions.ChannelNotFoundEntity, 404),
        (aiormq.exceptions.ChannelLockedResource, 405),
        (aiormq.exceptions.ChannelPreconditionFailed, 406),
        (aiormq.exceptions.ConnectionNotAllowed, 530),
    )


def amqp_reply_code(exc: BaseException) -> int | None:
    """The AMQP reply code an aiormq error stands for: by its class, else (a code aiormq has no
    class for) the first argument of ChannelClosed / ConnectionClosed; None when it has none."""
    import aiormq.exceptions

    for cls, code in _code_of_class():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, aiormq.exceptions.ChannelClosed | aiormq.exceptions.ConnectionClosed):
        first = exc.args[0] if exc.args else None
        if isinstance(first, int) and not isinstance(first, bool):
            return first
    return None


def convert_broker_error(exc: BaseException) -> BaseException:
    """Our error for a broker driver error: a refusal (by its reply code, or a login the broker
    cannot take) is BrokerRefused, a lost or missing broker BrokerUnavailable."""
    import aiormq.exceptions
    from aio_pika.exceptions import AMQPError

    if isinstance(exc, OrchError):
        return exc
    code = amqp_reply_code(exc)
    if code in _REFUSED_CODES or isinstance(exc, aiormq.exceptions.AuthenticationError):
        return BrokerRefused(_first_line(exc) or type(exc).__name__, code)
    if isinstance(
        exc,
        AMQPError
        | aiormq.exceptions.AMQPError
        | aiormq.exceptions.ChannelInvalidStateError
        | OSError
        | TimeoutError,
    ):
        if isinstance(exc, TimeoutError) and not _first_line(exc):
            # It says nothing of itself: "audit: TimeoutError", 32 times in an alarm.
            return BrokerUnavailable("the broker did not answer in time (TimeoutError)")
        return BrokerUnavailable(_first_line(exc) or type(exc).__name__)
    if type(exc) is Exception and not exc.args:
        # aiormq's reason for what was waiting on a connection or channel that closed
        # without an exception of its own.
        return BrokerUnavailable("broker connection closed")
    if isinstance(exc, StopAsyncIteration):
        # aiormq's handshake reading a frame from a connection the broker already closed (a
        # node shutting down): it ends its frame iterator instead of raising.
        return BrokerUnavailable("broker connection closed during the handshake")
    return exc


@contextlib.contextmanager
def _converting(convert: Callable[[BaseException], BaseException]) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        converted = convert(exc)
        if converted is exc:
            raise
        raise converted from exc


def database_errors() -> contextlib.AbstractContextManager[None]:
    """Convert database driver errors raised inside into the tree."""
    return _converting(convert_database_error)


def broker_errors() -> contextlib.AbstractContextManager[None]:
    """Convert broker driver errors raised inside into the tree."""
    return _converting(convert_broker_error)


def timed_out(exc: BaseException) -> bool:
    """Whether a DatabaseUnavailable (or BrokerUnavailable) came of a call that took too long:
    a slow server or link that may answer given time, unlike one that refused."""
    return isinstance(exc.__cause__, TimeoutError) or isinstance(exc, TimeoutError)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


# ------------------------------------------------------------------- an error as it is stored
#: A stored error (``observers.last_error``, a failure's event): its one line, then, when kind
#: code raised it, a blank line and Python's traceback from this line on.
TRACEBACK_START = "Traceback (most recent call last):\n"
#: The most of a traceback kept: its end, where the error was raised.
TRACEBACK_MAX = 6000


def stored_error(line: str, trace: str | None) -> str:
    """The error's line, and its traceback (cut to its last ``TRACEBACK_MAX`` characters)."""
    if not trace:
        return line
    if len(trace) > TRACEBACK_MAX:
        trace = f"{TRACEBACK_START}  ...\n{trace[-TRACEBACK_MAX:]}"
    return f"{line}\n\n{trace}"


def split_error(text: str | None) -> tuple[str | None, str | None]:
    """A stored error's line and its traceback (None: none was stored, as by earlier releases)."""
    if not text:
        return text, None
    line, mark, trace = text.partition(f"\n\n{TRACEBACK_START}")
    return (line, TRACEBACK_START + trace) if mark else (text, None)
