"""The README's run command: ``orch up`` brings a working cluster up and Ctrl-C takes it down."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import httpx

from orch.cluster import free_port, wait_for
from tests.conftest import Servers


async def test_orch_up_runs_a_cluster_and_stops_it(
    servers: Servers, database_url: str, prefix: str
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(ORCH_DATABASE_URL=database_url, ORCH_AMQP_URL=servers.amqp_url, ORCH_PREFIX=prefix)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orch",
        "up",
        "--services",
        "2",
        "--worker-count",
        "3",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as api:

            async def two_services() -> bool:
                try:
                    return len((await api.get("/services")).json()) == 2
                except httpx.HTTPError:
                    return False

            await wait_for(two_services, timeout=60, what="orch up: manager and 2 services")
            r = await api.post(
                "/observers", json={"name": "via-up", "kind": "ticker", "params": {"interval": 0.1}}
            )
            assert r.status_code == 201, r.text

            async def running() -> bool:
                body = (await api.get(f"/observers/{r.json()['id']}")).json()
                return body["status"] == "processing" and body["checkpoint"] is not None

            await wait_for(running, timeout=20, what="observer running under orch up")
        # Ctrl-C reaches the whole process group, as in a terminal.
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert f"http://127.0.0.1:{port}" in text
    pgrep = await asyncio.create_subprocess_exec(
        "pgrep", "-f", f"--port {port}", stdout=asyncio.subprocess.PIPE
    )
    left, _ = await pgrep.communicate()
    assert left.strip() == b"", "orch up left processes behind"
