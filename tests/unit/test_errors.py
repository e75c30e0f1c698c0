"""The one error tree: driver errors are converted at the edges, by SQLSTATE and constraint
name, never by their text."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from aiormq.base import FutureStore
from aiormq.exceptions import (
    AMQPConnectionError,
    AuthenticationError,
    ChannelAccessRefused,
    ChannelClosed,
    ChannelInvalidStateError,
    ChannelLockedResource,
    ChannelNotFoundEntity,
    ChannelPreconditionFailed,
    ConnectionClosed,
    ConnectionNotAllowed,
    ProbableAuthenticationError,
)

from orch_contracts.errors import (
    BrokerRefused,
    BrokerUnavailable,
    Conflict,
    DatabaseUnavailable,
    InvalidInput,
    LeaseLost,
    NameTaken,
    OrchError,
    broker_errors,
    convert_database_error,
    database_errors,
)


def _unique(constraint: str, message: str = "duplicate key") -> asyncpg.UniqueViolationError:
    exc = asyncpg.UniqueViolationError(message)
    exc.constraint_name = constraint
    return exc


def test_name_taken_is_known_by_the_constraint_name_alone() -> None:
    assert isinstance(convert_database_error(_unique("uq_observers_live_name", "x")), NameTaken)
    misleading = _unique("pk_services", "uq_observers_live_name mentioned in the text")
    converted = convert_database_error(misleading)
    assert isinstance(converted, Conflict)
    assert not isinstance(converted, NameTaken)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (asyncpg.exceptions.CharacterNotInRepertoireError("NUL"), InvalidInput),
        (asyncpg.exceptions.NumericValueOutOfRangeError("2^63"), InvalidInput),
        (asyncpg.exceptions.AdminShutdownError("terminating"), DatabaseUnavailable),
        (asyncpg.exceptions.CannotConnectNowError("starting up"), DatabaseUnavailable),
        (asyncpg.exceptions.TooManyConnectionsError("too many"), DatabaseUnavailable),
        (asyncpg.exceptions.ConnectionDoesNotExistError("closed"), DatabaseUnavailable),
        (asyncpg.exceptions.IdleInTransactionSessionTimeoutError("idle"), DatabaseUnavailable),
        (ConnectionRefusedError(111, "refused"), DatabaseUnavailable),
        (TimeoutError(), DatabaseUnavailable),
    ],
)
def test_database_errors_become_ours(error: BaseException, expected: type[OrchError]) -> None:
    with pytest.raises(expected), database_errors():
        raise error


def test_a_bug_stays_a_bug() -> None:
    with pytest.raises(asyncpg.PostgresSyntaxError), database_errors():
        raise asyncpg.PostgresSyntaxError("syntax error at or near")
    with pytest.raises(KeyError), database_errors():
        raise KeyError("x")


@pytest.mark.parametrize(
    "error",
    [
        AMQPConnectionError("gone"),
        ChannelInvalidStateError("closed"),
        OSError("reset"),
        # aiormq's handshake on a connection the broker closed already: a service's broker
        # loop died of it, and the process exited (chaos seed 20261130 in CI).
        StopAsyncIteration(),
    ],
)
def test_broker_errors_become_ours(error: BaseException) -> None:
    with pytest.raises(BrokerUnavailable), broker_errors():
        raise error


def test_a_broker_that_did_not_answer_in_time_says_so() -> None:
    """The manager's loops log the error's text: it was "audit: TimeoutError", 32 times."""
    with pytest.raises(BrokerUnavailable, match="did not answer in time"), broker_errors():
        raise TimeoutError


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ChannelAccessRefused("ACCESS_REFUSED - no configure permission"), 403),
        (ChannelPreconditionFailed("PRECONDITION_FAILED - inequivalent arg"), 406),
        (ProbableAuthenticationError("ACCESS_REFUSED - login refused"), 403),
        (ConnectionNotAllowed("NOT_ALLOWED - vhost / not allowed"), 530),
        (ChannelClosed(406, "a code aiormq has no class for comes as the first argument"), 406),
        (ConnectionClosed(530, "not allowed"), 530),
        (AuthenticationError(["AMQPLAIN"], ["PLAIN"]), None),
    ],
)
def test_a_refusal_is_known_by_its_reply_code_and_never_retried(
    error: BaseException, code: int | None
) -> None:
    """The same declaration or login again gets the same no: retrying it would loop forever."""
    with pytest.raises(BrokerRefused) as info, broker_errors():
        raise error
    assert not isinstance(info.value, BrokerUnavailable)
    assert info.value.reply_code == code


@pytest.mark.parametrize(
    "error",
    [
        ChannelNotFoundEntity("NOT_FOUND - no queue"),  # declared again on the next session
        ChannelLockedResource("RESOURCE_LOCKED - exclusive queue"),  # its owner is leaving
        ConnectionClosed(320, "CONNECTION_FORCED - broker shutdown"),
        ChannelClosed(None, None),
    ],
)
def test_what_a_new_session_can_mend_stays_transient(error: BaseException) -> None:
    with pytest.raises(BrokerUnavailable), broker_errors():
        raise error


async def test_a_close_without_a_reason_is_the_broker_gone_not_a_bug() -> None:
    """aiormq fails what was waiting on a connection or channel that closed without an
    exception with a bare ``Exception()`` (its future store's reject reason). It ended the
    leader's sweeper twice in a chaos run (a probe pending when the connection closed after a
    memory alarm): it is the broker gone, not a bug."""
    store = FutureStore(loop=asyncio.get_running_loop())
    waiting: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    store.add(waiting)
    await store.reject_all(None)
    with pytest.raises(BrokerUnavailable, match="closed"), broker_errors():
        await waiting
    with pytest.raises(Exception, match="a reason") as info, broker_errors():
        raise Exception("a reason")  # an exception with a message stays what it is
    assert type(info.value) is Exception


def test_what_kind_code_sees_is_outside_the_tree() -> None:
    assert not issubclass(LeaseLost, Exception)
    with pytest.raises(LeaseLost), database_errors():
        raise LeaseLost("no")


def test_no_log_line_carries_a_password(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from orch_contracts import logs

    for fmt in ("text", "json"):
        logs.configure("INFO", fmt, service="s")
        logging.getLogger("t").warning(
            "cannot reach %s", "postgresql://orch:hunter2@db:5432/orchestrator"
        )
        err = capsys.readouterr().err
        assert "hunter2" not in err
        assert "postgresql://orch:***@db:5432/orchestrator" in err
    logging.getLogger().handlers.clear()


def test_a_failed_migration_never_prints_the_password() -> None:
    import subprocess
    import sys

    env = {"ORCH_DATABASE_URL": "postgresql://orch:hunter2@127.0.0.1:1/x", "PATH": ""}
    r = subprocess.run(
        [sys.executable, "-m", "orch", "migrate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 1
    assert "hunter2" not in r.stdout + r.stderr
    assert "cannot reach Postgres at 127.0.0.1:1/x" in r.stderr
