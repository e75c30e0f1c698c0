"""The consumer's side against the real broker: messages in the outputs format, published with
plain aio-pika (a repeat, a gap among them), read by ``orch_contracts.reader`` and by ``orch outputs
tail`` run as a command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import aio_pika
import pytest

from orch_contracts.outputs import Output
from orch_contracts.reader import OutputReader
from tests.conftest import Servers

ROOT = Path(__file__).resolve().parents[2]


def test_the_reader_drops_repeats_and_names_gaps() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()

    def out(o: uuid.UUID, seq: int) -> Output:
        return Output(o, seq, 1, "k", "n", 0.0, {"seq": seq})

    reader = OutputReader()
    got = [reader.accept(out(a, s)) for s in (1, 2, 2, 1, 3, 6, 4, 7)]
    assert [v.deliver for v in got] == [True, True, False, False, True, True, False, True]
    assert got[5].gap == (4, 5)
    assert reader.gaps == [(a, 4, 5)]
    assert (reader.delivered, reader.repeats) == (5, 3)
    # Resumed from what a consumer stored: the next seq is 11; one joining late starts anywhere.
    reader.resume({str(b): 10})
    assert reader.accept(out(b, 10)).deliver is False
    assert reader.accept(out(b, 11)).gap is None
    late = OutputReader(from_start=False)
    assert late.accept(out(a, 40)).gap is None
    assert late.accept(out(a, 42)).gap == (41, 41)
    with pytest.raises(ValueError, match="not an output"):
        reader.accept(b"{}", {"seq": 1})


async def _publish(
    url: str,
    prefix: str,
    observer: uuid.UUID,
    seqs: list[int],
    name: str = "btc",
    kind: str = "quotes",
) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            f"{prefix}.outputs", aio_pika.ExchangeType.TOPIC, durable=True
        )
        for seq in seqs:
            o = Output(observer, seq, 3, kind, name, 1796252515.25, {"p": seq})
            await exchange.publish(
                aio_pika.Message(
                    json.dumps(o.record).encode(), message_id=o.message_id, headers=o.headers()
                ),
                routing_key=kind,
            )
    finally:
        await connection.close()


async def test_orch_outputs_tail_prints_records_once_and_gaps(
    servers: Servers, prefix: str
) -> None:
    env = _tail_env(servers, prefix)
    observer = uuid.uuid4()
    await _publish(servers.amqp_url, prefix, observer, [])  # the exchange exists
    proc = subprocess.Popen(  # noqa: ASYNC220 - a process of its own, read from a thread
        [sys.executable, "-m", "orch", "outputs", "tail", "--kind", "quotes"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        await _tail_bound(prefix, "quotes")
        await _publish(servers.amqp_url, prefix, observer, [5, 6, 6, 9])
        lines: list[str] = []
        assert proc.stdout is not None
        async with asyncio.timeout(15):
            while not any(" seq 9 " in line for line in lines):
                lines.append(await asyncio.to_thread(proc.stdout.readline))
    finally:
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 0, stderr
    lines += rest.splitlines()
    records = [line for line in lines if " seq " in line and not line.startswith("gap")]
    assert [line.split(" seq ")[1].split()[0] for line in records] == ["5", "6", "9"]
    assert any(line.startswith("gap: btc seq 7..8") for line in lines), lines
    assert "3 record(s), 1 repeat(s), 1 gap(s)" in stderr


def _tail_env(servers: Servers, prefix: str) -> dict[str, str]:
    """What ``orch outputs tail`` runs with: this test's broker and prefix."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ORCH_AMQP_URL": servers.amqp_url,
        "ORCH_PREFIX": prefix,
    }


async def _tail_bound(prefix: str, kind: str) -> None:
    for _ in range(100):
        out = await asyncio.to_thread(
            subprocess.run,
            ["rabbitmqctl", "-q", "list_bindings", "source_name", "routing_key"],
            capture_output=True,
            text=True,
        )
        if any(
            line.split("\t")[:2] == [f"{prefix}.outputs", kind] for line in out.stdout.splitlines()
        ):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("orch outputs tail never bound its queue")


async def test_orch_outputs_tail_ends_quietly_when_its_reader_goes(
    servers: Servers, prefix: str
) -> None:
    """``orch outputs tail | head -2``: once ``head`` has its lines and goes, the next write
    ends the command as a broken pipe ends any Unix tool (141, 128 + SIGPIPE), saying
    nothing."""
    env = _tail_env(servers, prefix)
    observer = uuid.uuid4()
    await _publish(servers.amqp_url, prefix, observer, [])  # the exchange exists
    proc = subprocess.Popen(  # noqa: ASYNC220 - a process of its own, read from a thread
        [sys.executable, "-m", "orch", "outputs", "tail", "--kind", "quotes"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        await _tail_bound(prefix, "quotes")
        await _publish(servers.amqp_url, prefix, observer, [1, 2])
        assert proc.stdout is not None
        async with asyncio.timeout(15):
            for _ in range(2):
                assert " seq " in await asyncio.to_thread(proc.stdout.readline)
        proc.stdout.close()  # head has its two lines
        await _publish(servers.amqp_url, prefix, observer, [3, 4, 5])
        code = await asyncio.to_thread(proc.wait, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        proc.wait()
    assert code == 141, stderr
    assert stderr == ""


async def test_orch_outputs_tail_takes_an_observers_name_or_id(
    servers: Servers, prefix: str
) -> None:
    """``--observer`` is an id or a name, as everywhere else (it took ids only)."""
    env = _tail_env(servers, prefix)
    btc, eth = uuid.uuid4(), uuid.uuid4()
    await _publish(servers.amqp_url, prefix, btc, [])  # the exchange exists
    # A kind for each round: the last round's queue may not be gone yet.
    for n, (wanted, seen) in enumerate(((eth, "eth"), ("eth", "eth"), (str(btc), "btc"))):
        kind = f"quotes{n}"
        proc = subprocess.Popen(  # noqa: ASYNC220 - a process of its own, read from a thread
            [
                sys.executable,
                "-m",
                "orch",
                "outputs",
                "tail",
                "--kind",
                kind,
                "--observer",
                str(wanted),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            await _tail_bound(prefix, kind)
            await _publish(servers.amqp_url, prefix, btc, [1, 2], name="btc", kind=kind)
            await _publish(servers.amqp_url, prefix, eth, [1], name="eth", kind=kind)
            assert proc.stdout is not None
            async with asyncio.timeout(15):
                line = await asyncio.to_thread(proc.stdout.readline)
        finally:
            proc.send_signal(signal.SIGINT)
            rest, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 0, stderr
        shown = [x for x in [line, *rest.splitlines()] if " seq " in x]
        assert shown, stderr
        assert all(x.startswith(f"{seen} ") or f" {seen} " in x for x in shown), shown
        assert not any(("eth" if seen == "btc" else "btc") in x for x in shown), shown


def _named(prefix: str, what: str) -> list[str]:
    out = subprocess.run(
        ["rabbitmqctl", "-q", f"list_{what}", "name"], capture_output=True, text=True, check=True
    )
    return [n for n in out.stdout.split() if n.startswith(f"{prefix}.")]


async def test_delete_topology_leaves_nothing_of_its_prefix(servers: Servers, prefix: str) -> None:
    """What ``orch verify``, ``orch bench`` and the tests clean up with: the outputs exchange
    goes with the rest."""
    from orch_contracts.topology import (
        Topology,
        broker_version,
        declare_topology,
        delete_topology,
    )

    connection = await aio_pika.connect(servers.amqp_url)
    async with connection:
        await declare_topology(
            await connection.channel(),
            Topology(prefix),
            version=broker_version(connection),
            queue_type="classic",
            consumer_timeout_ms=604_800_000,
        )
    assert f"{prefix}.outputs" in await asyncio.to_thread(_named, prefix, "exchanges")
    await delete_topology(servers.amqp_url, Topology(prefix))
    assert await asyncio.to_thread(_named, prefix, "exchanges") == []
    assert await asyncio.to_thread(_named, prefix, "queues") == []
