"""Test fixtures: real Postgres and RabbitMQ, a fresh database and broker prefix per test.

Servers come from ORCH_TEST_DATABASE_URL / ORCH_TEST_AMQP_URL; without them, from containers
where Docker runs (testcontainers), else from the local servers on their default ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from orch_contracts.settings import asyncpg_dsn, on_database
from orch_contracts.topology import Topology, delete_topology
from tests.support.cluster import Cluster

#: The kit kind authors get: ``kind_run`` and ``virtual_clock`` (tests/unit/test_builtin_kinds.py).
pytest_plugins = ["orch.testing"]

RUN = uuid.uuid4().hex[:8]
_counter = itertools.count(1)


@pytest.fixture(autouse=True)
def _turn(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` (it changes the shared servers' global state:
    a broker restart or alarm, a broker setting; or it needs the machine to itself) runs while
    no other test does; the others run side by side. A readers-writer lock over the workers'
    common temporary directory, made fair by a gate: a waiting ``alone`` test holds it, so the
    tests that come after wait behind it instead of starving it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    common = tmp_path_factory.getbasetemp().parent
    with open(common / "gate.lock", "a+") as gate, open(common / "turn.lock", "a+") as turn:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Servers:
    admin_dsn: str  # postgresql://user@host:port (no database)
    amqp_url: str

    def database_url(self, name: str) -> str:
        return on_database(self.admin_dsn, name)

    def asyncpg_dsn(self, name: str) -> str:
        return asyncpg_dsn(self.database_url(name))


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    db = os.environ.get("ORCH_TEST_DATABASE_URL")
    amqp = os.environ.get("ORCH_TEST_AMQP_URL")
    if db is None and amqp is None and _docker_available():
        from testcontainers.postgres import PostgresContainer
        from testcontainers.rabbitmq import RabbitMqContainer

        with PostgresContainer("postgres:16") as pg, RabbitMqContainer("rabbitmq:3.13") as mq:
            host, port = pg.get_container_host_ip(), pg.get_exposed_port(5432)
            yield Servers(
                f"postgresql://{pg.username}:{pg.password}@{host}:{port}",
                f"amqp://guest:guest@{mq.get_container_host_ip()}:{mq.get_exposed_port(5672)}/",
            )
        return
    db = asyncpg_dsn(db or "postgresql://postgres@127.0.0.1:5432")
    yield Servers(db, amqp or "amqp://guest:guest@127.0.0.1:5672/")


async def _admin(servers: Servers, sql: str) -> None:
    admin = await asyncpg.connect(servers.asyncpg_dsn("postgres"))
    try:
        await admin.execute(sql)
    finally:
        await admin.close()


@pytest.fixture(scope="session")
async def template_db(servers: Servers) -> AsyncIterator[str]:
    """A database migrated once per run; each test's database is a copy of it."""
    from alembic import command

    from orch_migrations import alembic_config

    name = f"orch_t_{RUN}_tpl"
    await _admin(servers, f'CREATE DATABASE "{name}"')
    await asyncio.to_thread(command.upgrade, alembic_config(servers.database_url(name)), "head")
    yield name
    await _admin(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


#: Keys whose kept count (``observer_counts``) is not the number of observers with that key:
#: each count as kept that no key of the observers has, and each real one not kept.
_KEPT = (
    "SELECT status, kind, pool, service_id, CAST(sum(n) AS bigint) AS n FROM observer_counts "
    "GROUP BY 1, 2, 3, 4 HAVING sum(n) <> 0"
)
_REAL = "SELECT status, kind, pool, service_id, count(*) AS n FROM observers GROUP BY 1, 2, 3, 4"
COUNTS_WRONG = (
    f"SELECT 'kept' AS side, * FROM ({_KEPT} EXCEPT {_REAL}) k "
    f"UNION ALL SELECT 'real' AS side, * FROM ({_REAL} EXCEPT {_KEPT}) r"
)


async def counts_wrong(dsn: str) -> list[dict[str, object]]:
    """Where the observer counts the triggers keep disagree with the observers (none, ever);
    nothing for a database without them."""
    conn = await asyncpg.connect(dsn)
    try:
        if await conn.fetchval("SELECT to_regclass('observer_counts')") is None:
            return []
        return [dict(r) for r in await conn.fetch(COUNTS_WRONG)]
    finally:
        await conn.close()


@pytest.fixture
async def database_url(servers: Servers, template_db: str) -> AsyncIterator[str]:
    """A database of this test alone. After the test, the counts kept by triggers must still be
    the observers' (every test that writes observers checks them so)."""
    name = f"orch_t_{RUN}_{next(_counter)}"
    await _admin(servers, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield servers.database_url(name)
    try:
        wrong = await counts_wrong(servers.asyncpg_dsn(name))
    finally:
        await _admin(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert not wrong, f"observer_counts disagrees with observers: {wrong}"


@pytest.fixture
async def prefix(servers: Servers) -> AsyncIterator[str]:
    """A broker name prefix of this test alone; its queues and exchanges are deleted after."""
    value = f"t{RUN}.{next(_counter)}"
    yield value
    with contextlib.suppress(Exception):
        await delete_topology(servers.amqp_url, Topology(value))


@pytest.fixture
async def cluster(
    request: pytest.FixtureRequest,
    servers: Servers,
    database_url: str,
    prefix: str,
    tmp_path: Path,
) -> AsyncIterator[Cluster]:
    """A manager and services on the test's database and prefix: in the test's event loop
    (``tests/support/inprocess.py``), or real processes for a test marked ``processes``."""
    # Imported here: the unit tier never loads what the in-process tier runs.
    from tests.support.inprocess import InProcessCluster

    kind = Cluster if request.node.get_closest_marker("processes") else InProcessCluster
    c = kind(database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, workdir=tmp_path)
    await c.connect()
    try:
        yield c
    finally:
        await c.stop()
