"""The API's request spans, exported by a manager in a process of its own (a process sets its
tracer provider once), served by uvicorn on a port of its own, auth on, sampling at 0: a caller
without a good token starts no span under the trace id it sent, and no span carries a query
string's values or the Host a client claimed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import Servers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import asyncio, sys
import httpx, uvicorn
from orch_contracts import tracing
from orch_manager.app import create_app
from orch_manager.auth import Role, new_token
from orch_manager.settings import ManagerSettings
from orch.cluster import free_port

tracing.configure("manager", {"OTEL_TRACES_EXPORTER": "console"})
read, entry = new_token("reader", Role.READ)
settings = ManagerSettings(
    database_url=sys.argv[1], amqp_url=sys.argv[2], prefix=sys.argv[3], auth="on",
    api_tokens=entry, background=False,
)


async def main() -> None:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    forged = {"Host": "evil.example:8443"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        stranger = {**forged, "traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}
        r1 = await c.get("/observers?token=QSECRET1", headers=stranger)
        r2 = await c.get("/healthz?token=QSECRET2", headers=stranger)
        known = {
            **forged,
            "Authorization": f"Bearer {read}",
            "traceparent": f"00-{'c' * 32}-{'d' * 16}-01",
        }
        r3 = await c.get("/observers?limit=5&api_token=QSECRET3", headers=known)
        print("STATUS", r1.status_code, r2.status_code, r3.status_code, flush=True)
    server.should_exit = True
    await serving
    tracing.shutdown()


asyncio.run(main())
"""


def test_request_spans_trust_no_stranger_and_export_no_query_values_nor_host(
    servers: Servers, database_url: str, prefix: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, database_url, servers.amqp_url, prefix],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0",
        },
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "STATUS 401 200 200" in out, out
    decoder = json.JSONDecoder()
    spans = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r"^\{", out, re.M)]
    assert spans, "the known caller's request is exported under its own sampled trace"
    traces = {s["context"]["trace_id"] for s in spans}
    assert "0x" + "a" * 32 not in traces, "a stranger's trace id was continued"
    assert traces == {"0x" + "c" * 32}, traces
    for secret in ("QSECRET", "evil.example"):
        assert secret not in out, f"{secret} exported: {out}"
    (request,) = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert request["attributes"]["url.query"] == "limit=REDACTED&api_token=REDACTED"
    assert request["attributes"]["server.address"] == "127.0.0.1"
