"""A process that cannot start says why in one line and exits: no traceback, no retry loop on
what no retry can mend, and a wait (``--wait``) for what is only not there yet."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aio_pika
import asyncpg
import pytest

from orch.cluster import free_port
from orch_contracts.topology import Topology, broker_version, work_queue_arguments
from tests.conftest import Servers
from tests.support.cluster import ROOT


@dataclass
class Ended:
    code: int
    output: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()]


async def _orch(*args: str, env: dict[str, str], timeout: float = 60) -> Ended:
    """``orch ARGS`` as a real process, until it exits. One still running after ``timeout`` is
    made to print where each of its threads is (faulthandler, on SIGABRT), then killed by its
    pid, and the test fails with that output."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    full = {
        **base,
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "300",  # one line stays one line
        "ORCH_KIND_MODULES": "tests.support.kinds",
        **env,
    }
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orch",
        *args,
        env=full,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    reading = asyncio.ensure_future(proc.communicate())
    try:
        done, _ = await asyncio.wait([reading], timeout=timeout)
        if not done:
            proc.send_signal(signal.SIGABRT)
            done, _ = await asyncio.wait([reading], timeout=10)
            hung = reading.result()[0].decode(errors="replace") if done else ""
            pytest.fail(f"orch {' '.join(args)} still ran after {timeout} s:\n{hung}")
        out, _ = reading.result()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if not reading.done():
            reading.cancel()
    assert proc.returncode is not None
    return Ended(proc.returncode, out.decode(errors="replace"), time.monotonic() - started)


@pytest.mark.parametrize("command", ["service", "manager"])
async def test_a_work_queue_of_another_type_stops_the_start_with_its_fix(
    servers: Servers, database_url: str, prefix: str, command: str
) -> None:
    """An ORCH_QUEUE_TYPE change (classic -> quorum) makes the broker refuse the declaration
    (406): it used to be retried forever as "broker unreachable", even with a wait."""
    topology = Topology(prefix)
    connection = await aio_pika.connect(servers.amqp_url)
    async with connection:
        channel = await connection.channel()
        args = work_queue_arguments(
            version=broker_version(connection),
            queue_type="classic",
            consumer_timeout_ms=7 * 24 * 3600 * 1000,
        )
        args["x-dead-letter-exchange"] = topology.dead_letter_exchange
        await channel.declare_queue(topology.work_queue, durable=True, arguments=args)
    # (The prefix fixture deletes the queues afterwards.)
    ended = await _orch(
        command,
        env={
            "ORCH_DATABASE_URL": database_url,
            "ORCH_AMQP_URL": servers.amqp_url,
            "ORCH_PREFIX": prefix,
            "ORCH_QUEUE_TYPE": "quorum",
            "ORCH_WAIT": "30",  # a refusal does not wait: no wait can mend it
            "ORCH_AUTH": "disabled",
            "ORCH_PORT": str(free_port()),
        },
    )
    assert ended.code != 0, ended.output
    assert "Traceback" not in ended.output, ended.output
    assert ended.lines == [
        f"error: the work queue {topology.work_queue} exists with other arguments "
        "(x-queue-type classic, asked quorum): delete it (its messages go with it) or set "
        "ORCH_QUEUE_TYPE back"
    ], ended.output
    assert ended.seconds < 15, ended.seconds


@pytest.fixture
async def limited_role(servers: Servers) -> AsyncIterator[str]:
    """A role allowed one connection: the start-up check gets it, the service's pool (several
    at once) does not, as on a server whose connections are all but exhausted. The shared
    server's max_connections is left alone."""
    role = f"orch_test_limit_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(servers.asyncpg_dsn("postgres"))
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1 IN ROLE postgres')
        yield role
    finally:
        try:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
            )
            await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        finally:
            await admin.close()


def _as_role(database_url: str, role: str) -> str:
    """``database_url`` with ``role`` as the user (the test server trusts local users)."""
    scheme, rest = database_url.split("://", 1)
    return f"{scheme}://{role}@{rest.split('@', 1)[1]}"


@pytest.mark.parametrize("wait", [0, 2])
async def test_a_database_out_of_connections_is_waited_for_then_one_line(
    servers: Servers, database_url: str, limited_role: str, wait: int, prefix: str
) -> None:
    """A server at its connection limit is a server not there: waited for (each try a line),
    then one line. It used to end in TooManyConnectionsError's traceback at once, whatever the
    wait."""
    url = _as_role(database_url, limited_role)
    ended = await _orch(
        "service",
        "--wait",
        str(wait),
        env={"ORCH_DATABASE_URL": url, "ORCH_AMQP_URL": servers.amqp_url, "ORCH_PREFIX": prefix},
    )
    assert ended.code != 0, ended.output
    assert "Traceback" not in ended.output, ended.output
    *tries, last = ended.lines
    assert all("trying again" in line for line in tries), ended.output
    assert len(tries) == 0 if wait == 0 else len(tries) >= 1, ended.output
    assert last.startswith("error: "), ended.output
    assert f'too many connections for role "{limited_role}"' in last, ended.output
    assert wait <= ended.seconds < wait + 10, ended.seconds


@pytest.mark.parametrize("command", ["service", "manager"])
async def test_a_trace_exporter_it_does_not_have_is_one_line(command: str) -> None:
    ended = await _orch(command, env={"OTEL_TRACES_EXPORTER": "jaeger", "ORCH_AUTH": "disabled"})
    assert ended.code != 0, ended.output
    assert ended.lines == [
        "error: OTEL_TRACES_EXPORTER='jaeger': jaeger not supported (use otlp or console, or none)"
    ], ended.output


@pytest.mark.parametrize("command", ["service", "manager"])
async def test_a_database_without_synchronous_replication_is_refused_when_required(
    servers: Servers, database_url: str, prefix: str, command: str
) -> None:
    """ORCH_REQUIRE_SYNCHRONOUS_REPLICATION: a server a failover could lose acknowledged writes
    on (here one with no standby at all) is refused in one line, at once."""
    ended = await _orch(
        command,
        env={
            "ORCH_DATABASE_URL": database_url,
            "ORCH_AMQP_URL": servers.amqp_url,
            "ORCH_PREFIX": prefix,
            "ORCH_REQUIRE_SYNCHRONOUS_REPLICATION": "true",
            "ORCH_WAIT": "30",
            "ORCH_AUTH": "disabled",
            "ORCH_PORT": str(free_port()),
        },
    )
    assert ended.code != 0, ended.output
    assert "Traceback" not in ended.output, ended.output
    assert ended.lines[-1].startswith(
        "error: ORCH_REQUIRE_SYNCHRONOUS_REPLICATION is set, and the database's durability is "
        "single"
    ), ended.output
    assert ended.seconds < 15, ended.seconds
