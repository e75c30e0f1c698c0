"""The start-up checks both processes run before anything else (``contracts/preflight.py``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orch_contracts.errors import StartupError
from orch_contracts.preflight import NotYet, check_servers
from orch_contracts.settings import CommonSettings
from tests.conftest import Servers

TRIES = 60


async def test_a_refusal_ends_the_process_at_once_however_far_the_other_check_got(
    servers: Servers, database_url: str, prefix: str
) -> None:
    """A refusal from the database check (no synchronous standby, where one is required) while
    the broker check is still declaring: ``asyncio.run`` returns with the refusal. It cancelled
    the broker check together with its connection's reader, and the check then waited forever
    to close its connection (CI's ``orch service`` hung 60 s, one run in about fifteen here)."""
    settings = CommonSettings(
        database_url=database_url,
        amqp_url=servers.amqp_url,
        prefix=prefix,
        require_synchronous_replication=True,
    )

    def tries() -> list[BaseException]:
        errors: list[BaseException] = []
        for _ in range(TRIES):
            try:
                asyncio.run(check_servers(settings))  # as `orch service` runs it: its own loop
            except StartupError as exc:
                errors.append(exc)
        return errors

    done: list[list[BaseException]] = []
    runner = threading.Thread(target=lambda: done.append(tries()), daemon=True)
    runner.start()
    await asyncio.to_thread(runner.join, 30)
    assert done, f"a start-up check still ran after 30 s ({TRIES} tries)"
    assert len(done[0]) == TRIES
    assert not any(isinstance(e, NotYet) for e in done[0])
    assert all("ORCH_REQUIRE_SYNCHRONOUS_REPLICATION" in str(e) for e in done[0])


async def test_a_server_not_there_is_waited_for_and_named() -> None:
    with pytest.raises(NotYet, match="cannot reach Postgres"):
        await check_servers(
            CommonSettings(
                database_url="postgresql+asyncpg://postgres@127.0.0.1:1/x",
                amqp_url="amqp://guest:guest@127.0.0.1:1/",
            )
        )
