"""``orch bench --quick`` runs end to end and its JSON carries every figure (values not judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Servers

#: It needs the machine, or the shared servers, to itself.
pytestmark = pytest.mark.alone

EXPECTED = {
    "start latency": 3,
    "create throughput": 7,
    "bulk intake": 4,
    "cancel latency": 3,
    "crash failover, 20 moved": 6,
    "freeze failover (SIGSTOP)": 4,
    "graceful move (SIGTERM)": 4,
    "join rebalance": 4,
    "cost growth": 4,
}


@pytest.mark.slow
def test_quick_bench_reports_every_figure(servers: Servers, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(ORCH_DATABASE_URL=servers.asyncpg_dsn("postgres"), ORCH_AMQP_URL=servers.amqp_url)
    proc = subprocess.run(
        [sys.executable, "-m", "orch", "bench", "--quick", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert {"cpus", "postgres", "rabbitmq"} <= set(report["machine"])
    counts: dict[str, int] = {}
    statements: dict[str, list[dict[str, object]]] = {}
    for f in report["figures"]:
        assert f["name"] != "scenario failed", f
        assert {"scenario", "name", "value", "unit", "target", "passed"} <= set(f)
        if f["name"].startswith(("statement #", "top statements")):
            statements.setdefault(f["scenario"], []).append(f)
            continue
        counts[f["scenario"]] = counts.get(f["scenario"], 0) + 1
    assert counts == EXPECTED
    # The top statements, or why the server cannot give them (not preloaded), never nothing.
    for scenario in ("create throughput", "bulk intake"):
        found = statements[scenario]
        assert found[0]["value"] is not None or "shared_preload_libraries" in str(found[0]["note"])
    assert "orch bench --quick" in proc.stdout
