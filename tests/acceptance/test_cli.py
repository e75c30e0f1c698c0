"""The README's run command: ``orch up`` brings a working cluster up and Ctrl-C takes it down."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from orch.cluster import free_port, wait_for
from tests.conftest import Servers
from tests.support.cluster import Cluster


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
        # orch up makes an admin token for the run and prints it.
        assert proc.stdout is not None
        seen = b""
        while b"export ORCH_TOKEN=" not in seen:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, f"orch up ended: {seen.decode(errors='replace')}"
            seen += line
        token = seen.split(b"export ORCH_TOKEN=")[1].split()[0].decode()
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10, headers=headers
        ) as api:
            assert (
                await api.get("/services", headers={"Authorization": "Bearer x"})
            ).status_code == 401

            async def two_services() -> bool:
                try:
                    return len((await api.get("/services")).json()) == 2
                except httpx.HTTPError:
                    return False

            await wait_for(two_services, timeout=60, what="orch up: manager and 2 services")
            # Each service serves its metrics on a port orch up printed.
            metrics = re.findall(r"local-\d+: (http://127\.0\.0\.1:\d+/metrics)", seen.decode())
            assert len(metrics) == 2, seen.decode()
            for url in metrics:
                page = await api.get(url)
                assert page.status_code == 200
                assert "orch_observers_running" in page.text
            r = await api.post(
                "/observers", json={"name": "via-up", "kind": "ticker", "params": {"interval": 0.1}}
            )
            assert r.status_code == 201, r.text

            async def running() -> bool:
                body = (await api.get(f"/observers/{r.json()['id']}")).json()
                return body["status"] == "processing" and body["checkpoint"] is not None

            await wait_for(running, timeout=20, what="observer running under orch up")
            # kill -9 of the service that runs it: the observer moves, and orch up starts the
            # service again (the cluster stays up, as the README's walk-through shows).
            held = (await api.get(f"/observers/{r.json()['id']}")).json()
            services = (await api.get("/services")).json()
            (holder,) = [s for s in services if s["id"] == held["service_id"]]
            os.kill(holder["pid"], signal.SIGKILL)

            async def moved_and_back() -> bool:
                body = (await api.get(f"/observers/{r.json()['id']}")).json()
                now = (await api.get("/services")).json()
                return (
                    body["status"] == "processing"
                    and body["service_id"] not in (None, holder["id"])
                    and len(now) == 2
                    and holder["pid"] not in {s["pid"] for s in now}
                )

            await wait_for(moved_and_back, timeout=60, what="moved, and the service started again")
        # Ctrl-C reaches the whole process group, as in a terminal.
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        out = seen + out
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert f"http://127.0.0.1:{port}" in text
    assert "exited with code -9; starting it again" in text, text[-3000:]
    pgrep = await asyncio.create_subprocess_exec(
        "pgrep", "-f", f"--port {port}", stdout=asyncio.subprocess.PIPE
    )
    left, _ = await pgrep.communicate()
    assert left.strip() == b"", "orch up left processes behind"


def _orch(
    *args: str, api: str, token: str | None, columns: int = 200
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ORCH_API": api, "COLUMNS": str(columns), "ORCH_TOKEN": token or ""}
    return subprocess.run(
        [sys.executable, "-m", "orch", *args], capture_output=True, text=True, env=env, timeout=120
    )


async def _run(
    cluster: Cluster,
    *args: str,
    api: str | None = None,
    token: str | None = "admin",
    columns: int = 200,
) -> subprocess.CompletedProcess[str]:
    """``orch ARGS`` against the cluster's manager (or ``api``), with its admin token (or
    ``token``)."""
    url = api or f"http://127.0.0.1:{cluster.api_port}"
    given = cluster.token if token == "admin" else token
    return await asyncio.to_thread(_orch, *args, api=url, token=given, columns=columns)


async def test_every_action_from_the_command_line(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=5)
    version = await _run(cluster, "--version")
    assert version.returncode == 0
    assert version.stdout.startswith("observer-orchestrator ")
    created = await _run(
        cluster, "observers", "create", "cli-1", "ticker", "-p", "interval=0.05", "--json"
    )
    assert created.returncode == 0, created.stderr
    oid = json.loads(created.stdout)["id"]
    await cluster.wait_all_running([uuid.UUID(oid)], timeout=10)
    listed = json.loads(
        (await _run(cluster, "observers", "list", "--name", "cli-", "--json")).stdout
    )
    assert [o["id"] for o in listed] == [oid]
    table = await _run(cluster, "observers", "list")
    assert "cli-1" in table.stdout
    assert "processing" in table.stdout
    got = await _run(cluster, "observers", "get", oid)
    assert "checkpoint:" in got.stdout
    by_name = await _run(cluster, "observers", "get", "cli-1", "--json")
    assert json.loads(by_name.stdout)["id"] == oid
    nobody = await _run(cluster, "observers", "get", "no-such-name")
    assert nobody.returncode == 1
    assert "no observer named 'no-such-name'" in nobody.stderr
    paused = await _run(cluster, "observers", "pause", "cli-1", "--wait")
    assert paused.returncode == 0, paused.stderr
    assert f"{oid}: paused" in paused.stdout
    resumed = await _run(cluster, "observers", "resume", oid, "--wait")
    assert f"{oid}: processing" in resumed.stdout
    events = json.loads((await _run(cluster, "observers", "events", oid, "--json")).stdout)
    assert [e["event"] for e in events][:4] == ["created", "taken", "pausing", "paused"]
    assert events[1]["service_name"] == "a", "a history names its services"
    kinds = json.loads((await _run(cluster, "kinds", "--json")).stdout)
    assert "ticker" in {k["name"] for k in kinds}
    services = json.loads((await _run(cluster, "services", "list", "--json")).stdout)
    assert [s["running"] for s in services] == [1]
    # Drain by name and wait until it runs nothing: what a preStop hook does.
    await cluster.start_service("b", worker_count=5)
    drained = await _run(cluster, "services", "drain", "--name", "a", "--wait")
    assert drained.returncode == 0, drained.stderr
    assert "drained" in drained.stdout
    deleted = await _run(cluster, "observers", "delete", oid, "--wait")
    assert f"{oid}: deleted" in deleted.stdout
    # Deleted observers are left out of the list unless asked for, as the console does.
    listed = json.loads((await _run(cluster, "observers", "list", "--json")).stdout)
    assert oid not in [o["id"] for o in listed]
    every = json.loads((await _run(cluster, "observers", "list", "--deleted", "--json")).stdout)
    assert oid in [o["id"] for o in every]
    events_by_name = await _run(cluster, "observers", "events", "cli-1", "--json")
    assert json.loads(events_by_name.stdout)[-1]["event"] == "deleted"


async def test_import_creates_many_and_reports_each_failure(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.start_manager()
    many = [{"name": f"imp-{i}", "kind": "ticker", "params": {"interval": 60}} for i in range(1500)]
    many[7] = {"name": "imp-bad", "kind": "no-such-kind"}
    source = tmp_path / "observers.json"
    source.write_text(json.dumps(many))
    imported = await _run(cluster, "observers", "import", str(source))
    assert imported.returncode == 1, "one failed"
    assert "created 1499, failed 1" in imported.stdout
    assert "1499 will wait: no service is taking work" in imported.stderr
    # Numbered from 1, as an editor shows them: the 8th item of the array.
    assert "item 8 (imp-bad): unknown kind; known kinds:" in imported.stderr
    lines = tmp_path / "more.jsonl"
    lines.write_text(
        "\n".join(json.dumps({"name": f"line-{i}", "kind": "ticker"}) for i in range(3))
    )
    again = await _run(cluster, "observers", "import", str(lines), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["created"] == 3
    listed = await _run(cluster, "observers", "list", "--name", "imp-", "--all-pages", "--json")
    assert len(json.loads(listed.stdout)) == 1499


async def test_failures_print_the_api_message_and_exit_1_usage_exits_2(cluster: Cluster) -> None:
    await cluster.start_manager()
    missing = await _run(cluster, "observers", "get", str(uuid.uuid4()))
    assert missing.returncode == 1
    assert "404: no observer with id" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = await _run(cluster, "observers", "create", "x", "nope")
    assert bad.returncode == 1
    assert "unknown kind; known kinds:" in bad.stderr
    conflict = await _run(cluster, "observers", "resume", str(uuid.uuid4()))
    assert conflict.returncode == 1
    usage = await _run(cluster, "observers", "create")
    assert usage.returncode == 2
    unreachable = await _run(cluster, "kinds", api="http://127.0.0.1:1")
    assert unreachable.returncode == 1
    assert "cannot reach the manager" in unreachable.stderr


async def test_import_numbers_lines_from_1_gives_the_reasons_and_skips_a_bad_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.start_manager()
    lines = tmp_path / "observers.jsonl"
    lines.write_text(
        "\n".join(
            [
                json.dumps({"name": "ok-1", "kind": "ticker"}),
                "",
                '{"name": "broken", ',  # not JSON: fails alone
                json.dumps({"name": "no-kind"}),  # not valid: the API says which field
                json.dumps({"name": "ok-2", "kind": "ticker", "params": {"interval": 60}}),
            ]
        )
    )
    imported = await _run(cluster, "observers", "import", str(lines))
    assert imported.returncode == 1
    assert "created 2, failed 2" in imported.stdout
    assert "line 3: not JSON" in imported.stderr
    assert "line 4 (no-kind): the observer is not valid: kind: Field required" in imported.stderr
    listed = json.loads((await _run(cluster, "observers", "list", "--json")).stdout)
    assert sorted(o["name"] for o in listed) == ["ok-1", "ok-2"]
    as_json = await _run(cluster, "observers", "import", str(lines), "--json")
    items = json.loads(as_json.stdout)["items"]
    assert [(i["line"], i["status"]) for i in items] == [(1, 409), (3, 400), (4, 422), (5, 409)]


async def test_data_from_the_api_is_printed_as_it_is(cluster: Cluster) -> None:
    """Names, errors and params may hold Rich markup or terminal control characters: they are
    shown literally, never interpreted (rows from before the API refused such names)."""
    await cluster.start_manager()
    nasty = ["x[/red]", "[link=http://127.0.0.1/]click[/link]", "esc\x1b[31mRED"]
    ids = []
    for i in range(len(nasty)):
        created = await _run(cluster, "observers", "create", f"plain-{i}", "ticker", "--json")
        assert created.returncode == 0, created.stderr
        ids.append(json.loads(created.stdout)["id"])
    for oid, name in zip(ids, nasty, strict=True):
        await cluster.q(
            "UPDATE observers SET name = $2, last_error = $3, params = $4::jsonb WHERE id = $1",
            uuid.UUID(oid),
            name,
            f"boom [bold]{name}[/bold]",
            json.dumps({"note": name}),
        )
    listed = await _run(cluster, "observers", "list")
    assert listed.returncode == 0, listed.stderr
    assert "Traceback" not in listed.stderr
    for name in ("x[/red]", "[link=http://127.0.0.1/]click[/link]", "esc\\x1b[31mRED"):
        assert name in listed.stdout
    assert "\x1b" not in listed.stdout
    got = await _run(cluster, "observers", "get", ids[0])
    assert got.returncode == 0, got.stderr
    assert "last error: boom [bold]x[/red][/bold]" in got.stdout
    assert '{"note": "x[/red]"}' in got.stdout
    escaped = await _run(cluster, "observers", "get", ids[2])
    assert "esc\\x1b[31mRED" in escaped.stdout
    assert "\x1b" not in escaped.stdout


async def test_ids_are_whole_and_unknown_filters_name_what_exists(cluster: Cluster) -> None:
    await cluster.start_manager()
    created = await _run(cluster, "observers", "create", "a-long-name-" * 4, "ticker", "--json")
    oid = json.loads(created.stdout)["id"]
    narrow = await _run(cluster, "observers", "list", columns=80)
    assert oid in narrow.stdout, narrow.stdout
    quiet = await _run(cluster, "observers", "list", "-q", columns=80)
    assert quiet.stdout.split() == [oid]
    as_json = await _run(cluster, "observers", "list", "--json", columns=80)
    assert [o["id"] for o in json.loads(as_json.stdout)] == [oid]
    kind = await _run(cluster, "observers", "list", "--kind", "nosuch")
    assert kind.returncode == 2
    assert "unknown kind 'nosuch'" in kind.stderr
    assert "ticker" in kind.stderr
    status = await _run(cluster, "observers", "list", "--status", "nosuch")
    assert status.returncode == 2
    assert "processing" in status.stderr
    assert "paused" in status.stderr
    # A known kind with nothing of it is an empty list, not an error.
    empty = await _run(cluster, "observers", "list", "--kind", "http_poll", "--json")
    assert (empty.returncode, json.loads(empty.stdout)) == (0, [])


async def test_a_401_says_how_to_give_a_token(cluster: Cluster) -> None:
    await cluster.start_manager()
    anonymous = await _run(cluster, "observers", "list", token=None)
    assert anonymous.returncode == 1
    assert "401" in anonymous.stderr
    assert "ORCH_TOKEN" in anonymous.stderr
    assert "--token" in anonymous.stderr


async def test_undrain_lets_a_drained_service_take_work_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=5)
    b = await cluster.start_service("b", worker_count=5)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)
    nothing = await _run(cluster, "services", "drain")
    assert nothing.returncode == 2
    assert "give a service id or --name" in nothing.stderr
    assert "not both" not in nothing.stderr
    # A name serves as the id (it took ids only), --wait included.
    by_name = await _run(cluster, "services", "drain", "a", "--wait")
    assert by_name.returncode == 0, by_name.stderr
    assert str(a_id) in by_name.stdout

    async def create(name: str) -> uuid.UUID:
        made = await _run(cluster, "observers", "create", name, "ticker", "-p", "interval=0.1")
        assert made.returncode == 0, made.stderr
        return uuid.UUID(made.stdout.split()[1])

    first = await create("while-a-drains")
    await cluster.wait_all_running([first], timeout=20, on={b_id})
    # b alone takes work: 4 of its 5 slots are free, so 2 of 6 more wait, and the command
    # says so; they are deleted again by name.
    many = tmp_path / "six.jsonl"
    many.write_text("\n".join(json.dumps({"name": f"six-{i}", "kind": "ticker"}) for i in range(6)))
    six = await _run(cluster, "observers", "import", str(many))
    assert "2 will wait: only 4 free slots (of 5, 0 observers waiting before these)" in six.stderr
    for i in range(6):
        gone = await _run(cluster, "observers", "delete", f"six-{i}", "--wait")
        assert gone.returncode == 0, gone.stderr
    undrained = await _run(cluster, "services", "undrain", str(a_id))
    assert undrained.returncode == 0, undrained.stderr
    assert "taking work again" in undrained.stdout
    services = json.loads((await _run(cluster, "services", "list", "--json")).stdout)
    assert {s["name"]: s["draining"] for s in services} == {"a": False, "b": False}
    # With b drained in turn, a is the only one taking work: new observers land on it again,
    # and b's observer moves to it.
    assert (await _run(cluster, "services", "drain", "--name", "b", "--wait")).returncode == 0
    second = await create("after-undrain")
    await cluster.wait_all_running([first, second], timeout=30, on={a_id})
    again = await _run(cluster, "services", "undrain", "--name", "b")
    assert again.returncode == 0, again.stderr


async def test_one_action_on_every_observer_a_filter_selects(cluster: Cluster) -> None:
    await cluster.start_manager()
    for i in range(3):
        assert (await _run(cluster, "observers", "create", f"bulk-{i}", "ticker")).returncode == 0
    assert (await _run(cluster, "observers", "create", "kept", "ticker")).returncode == 0
    paused = await _run(cluster, "observers", "pause", "--name-prefix", "bulk-")
    assert paused.returncode == 0, paused.stderr
    assert "pause: 3 done, 0 failed" in paused.stdout
    # Resuming them and a running one: the one not paused fails alone, with its reason.
    await _run(cluster, "observers", "resume", "bulk-0")
    resumed = await _run(cluster, "observers", "resume", "--kind", "ticker", "--status", "paused")
    assert "resume: 2 done, 0 failed" in resumed.stdout, resumed.stdout + resumed.stderr
    again = await _run(cluster, "observers", "resume", "--name-prefix", "bulk-")
    assert again.returncode == 1
    assert "resume: 0 done, 3 failed" in again.stdout
    assert "only a paused observer" in again.stderr
    listed = json.loads((await _run(cluster, "observers", "list", "--json")).stdout)
    assert {o["name"]: o["status"] for o in listed} == dict.fromkeys(
        ["bulk-0", "bulk-1", "bulk-2", "kept"], "created"
    )
    neither = await _run(cluster, "observers", "pause")
    assert neither.returncode == 2
    assert "give one observer" in neither.stderr
    both = await _run(cluster, "observers", "pause", "kept", "--kind", "ticker")
    assert both.returncode == 2
