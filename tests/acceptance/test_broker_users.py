"""deploy/rabbitmq-users.sh on the real broker: a vhost of the test's own and a user per role
with the least permissions; a manager and services on those users create, run, move (handoff
and directed start), drain and delete observers, and a role cannot reach beyond its names.
The vhost and users are deleted afterwards, whatever happened."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import pytest
from aiormq.exceptions import ChannelAccessRefused

from orch.outputs_tail import tail
from orch_bench.ticklog import overlap_seconds, read_ticks
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import Topology
from tests.conftest import Servers
from tests.support.cluster import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "rabbitmq-users.sh"


@dataclass(frozen=True)
class Accounts:
    vhost: str
    manager_url: str
    service_url: str
    #: The test's own view of the vhost (guest, every permission there).
    operator_url: str
    #: A consumer of outputs.
    consumer_url: str = ""


def _url(base: str, user: str, password: str, vhost: str) -> str:
    parts = urlsplit(base)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, "/" + quote(vhost, safe=""), "", ""))


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=False, capture_output=True, timeout=60)


@pytest.fixture
def accounts(servers: Servers, prefix: str) -> Iterator[Accounts]:
    tag = uuid.uuid4().hex[:8]
    vhost, manager, service = f"orch-test-{tag}", f"orch-manager-{tag}", f"orch-service-{tag}"
    operator = urlsplit(servers.amqp_url).username or "guest"
    password = urlsplit(servers.amqp_url).password or "guest"
    env = {
        **os.environ,
        "VHOST": vhost,
        "PREFIX": prefix,
        "MANAGER_USER": manager,
        "MANAGER_PASSWORD": f"m-{tag}",
        "SERVICE_USER": service,
        "SERVICE_PASSWORD": f"s-{tag}",
        "OPERATOR_USER": operator,
        "CONSUMER_USER": f"orch-consumer-{tag}",
        "CONSUMER_PASSWORD": f"c-{tag}",
        "CONSUMER_QUEUE_MAX_LENGTH": "5",
    }
    try:
        done = subprocess.run(
            ["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        yield Accounts(
            vhost,
            _url(servers.amqp_url, manager, f"m-{tag}", vhost),
            _url(servers.amqp_url, service, f"s-{tag}", vhost),
            _url(servers.amqp_url, operator, password, vhost),
            _url(servers.amqp_url, f"orch-consumer-{tag}", f"c-{tag}", vhost),
        )
    finally:
        _ctl("delete_vhost", vhost)
        _ctl("delete_user", manager)
        _ctl("delete_user", service)
        _ctl("delete_user", f"orch-consumer-{tag}")


@pytest.fixture
async def on_vhost(
    accounts: Accounts, database_url: str, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    c = Cluster(
        database_url=database_url, amqp_url=accounts.operator_url, prefix=prefix, workdir=tmp_path
    )
    await c.connect()
    try:
        yield c
    finally:
        await c.stop()


async def test_each_role_works_on_its_own_user_and_vhost(
    on_vhost: Cluster, accounts: Accounts
) -> None:
    cluster = on_vhost
    await cluster.start_manager(
        amqp_url=accounts.manager_url,
        rebalance="true",
        rebalance_min_age="1",
        rebalance_interval="0.3",
    )
    a = await cluster.start_service("a", worker_count=10, amqp_url=accounts.service_url)
    ids = await cluster.create_recorders(6, interval=0.05)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=10, amqp_url=accounts.service_url)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)

    async def shared() -> bool:  # handoffs (manager -> a) and directed starts (a -> b)
        rows = await cluster.q(
            "SELECT service_id, count(*) AS n FROM observers WHERE status = 'processing' "
            "GROUP BY service_id"
        )
        return {r["service_id"]: r["n"] for r in rows} == {a_id: 3, b_id: 3}

    await wait_for(shared, timeout=20, what="3 observers moved to b")
    async with cluster.api() as c:
        assert (await c.delete(f"/observers/{ids[0]}")).status_code == 202
        assert (await c.post(f"/services/{b_id}/drain")).status_code == 202
    await cluster.wait_status(ids[0], "deleted", timeout=5)
    await cluster.wait_all_running(ids[1:], timeout=10, on={a_id})
    assert overlap_seconds(read_ticks(cluster.tick_dir)) == {}


@pytest.mark.parametrize("role", ["manager", "service"])
async def test_a_role_cannot_reach_beyond_its_names(
    accounts: Accounts, prefix: str, role: str
) -> None:
    topology = Topology(prefix)
    url = accounts.manager_url if role == "manager" else accounts.service_url
    refused = [f"{prefix}.other", "amq.gen-not-ours"]
    if role == "manager":  # it consumes nothing and owns no control queue
        refused.append(topology.control_queue(uuid.uuid4()))
    connection = await aio_pika.connect(url)
    try:
        for name in refused:
            channel = await connection.channel()
            with pytest.raises(ChannelAccessRefused):
                await channel.declare_queue(name, exclusive=True)
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            topology.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        with pytest.raises(ChannelAccessRefused):
            await channel.declare_exchange(f"{prefix}.other", aio_pika.ExchangeType.FANOUT)
        assert exchange is not None
    finally:
        await connection.close()
    # The default vhost: no access (the broker closes the connection as it opens).
    with pytest.raises(aio_pika.exceptions.AMQPError):
        await aio_pika.connect(url.rsplit("/", 1)[0] + "/")


async def test_the_consumer_role_runs_the_documented_consumer_and_tail(
    accounts: Accounts, prefix: str
) -> None:
    """As docs/outputs.md's consumer does (the exchange found passively, a durable queue of its
    own bound and consumed) and as ``orch outputs tail`` does; and its queues keep only the
    newest messages the length policy allows (5 here)."""
    topology = Topology(prefix)
    operator = await aio_pika.connect(accounts.operator_url)
    consumer = await aio_pika.connect(accounts.consumer_url)
    try:
        publish = await operator.channel()
        outputs = await publish.declare_exchange(
            topology.outputs_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        channel = await consumer.channel()
        exchange = await channel.get_exchange(topology.outputs_exchange)
        queue = await channel.declare_queue(topology.consumer_queue("changes"), durable=True)
        await queue.bind(exchange, routing_key="changes")
        for n in range(8):
            await outputs.publish(aio_pika.Message(str(n).encode()), routing_key="changes")

        async def capped() -> bool:
            seen = await channel.declare_queue(topology.consumer_queue("changes"), passive=True)
            return seen.declaration_result.message_count == 5

        await wait_for(capped, timeout=10, what="the length policy's cap")
        first = await queue.get(timeout=5)
        assert first.body == b"3", "the oldest were dropped"
        await first.ack()

        lines: list[str] = []
        stop = asyncio.Event()

        def show(text: str) -> None:
            lines.append(text)
            stop.set()

        settings = CommonSettings(
            database_url="postgresql://unused@127.0.0.1/unused",
            amqp_url=accounts.consumer_url,
            prefix=prefix,
        )
        tailing = asyncio.create_task(
            tail(settings, kind=None, observer=None, show=show, json_lines=False, stop=stop)
        )

        async def shown() -> bool:
            if tailing.done():
                tailing.result()  # raises what stopped it (ACCESS_REFUSED, say)
            await outputs.publish(aio_pika.Message(b"x"), routing_key="any")
            return bool(lines)

        await wait_for(shown, timeout=10, what="orch outputs tail's first line")
        async with asyncio.timeout(10):
            await tailing
        assert "not an output message" in lines[0]
    finally:
        await consumer.close()
        await operator.close()
