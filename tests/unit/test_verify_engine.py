"""``orch verify``'s parts without servers: the schedule, the witness file, the judge."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from observer_service.guard import Timing, guarded
from observer_service.stalls import StallWatch
from orch.cluster import Proc
from orch_contracts import witness
from orch_contracts.errors import LeaseLost
from orch_contracts.witness import Record, Witness
from orch_verify.campaign import FAULTS, Campaign, ObserverSpec, Planned, parse_faults, plan
from orch_verify.cluster import FaultCluster
from orch_verify.judge import GROWTH_FLAG, Verdict, judge
from orch_verify.run import parse_observer
from tests.support.bad_kinds import LeakyParams

O1, O2 = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"


def test_a_seed_draws_the_same_schedule_every_time() -> None:
    weights = parse_faults(None)
    a = plan(7, 60, weights)
    assert a == plan(7, 60, weights)
    assert a != plan(8, 60, weights)
    assert 40 <= len(a) <= 100  # one fault every 0.9 s on average
    assert all(0 < p.at < 60 for p in a)
    assert [p.at for p in a] == sorted(p.at for p in a)


def test_faults_are_drawn_by_weight_and_broker_restarts_only_when_asked() -> None:
    assert "broker_restart" not in parse_faults(None)
    assert "broker_restart" in parse_faults(None, broker_restart=True)
    assert "alarm" not in parse_faults(None), "an alarm blocks every publisher on the broker"
    assert "alarm" in parse_faults(None, broker_restart=True)
    assert {"crash_blip", "queue_deleted"} <= set(parse_faults(None))
    drawn = {p.fault for p in plan(1, 300, parse_faults("kill,freeze=2,churn=0"))}
    assert drawn == {"kill", "freeze"}
    assert set(FAULTS) >= {p.fault for p in plan(1, 300, parse_faults(None))}
    assert plan(1, 300, parse_faults("none")) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill,explode", "unknown fault 'explode'"),
        ("kill=lots", "must be a number"),
        ("kill=-1", "must not be negative"),
        ("kill=0", "no fault has a weight above zero"),
    ],
)
def test_a_wrong_fault_list_is_refused_with_its_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(text)


def _exited(code: int) -> Proc:
    proc = Proc(
        "manager", subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]), None
    )
    proc.popen.wait()
    return proc


def test_the_leader_is_not_killed_while_the_last_replacement_is_still_starting() -> None:
    """Otherwise no manager is left to serve the campaign's own creates and deletes."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    alive, dead = Proc("manager", subprocess.Popen(sleeper), None, port=1), _exited(0)
    said: list[str] = []
    campaign = Campaign(FaultCluster(env={}), 1, [], [], say=said.append)
    campaign.managers = [dead, alive]
    try:
        asyncio.run(campaign._kill_leader())
        assert alive.alive
        assert said[-1].endswith("leader (skipped: the other manager is not up yet)")
    finally:
        alive.popen.kill()
        alive.popen.wait()


def test_a_process_that_exits_unasked_is_noted_replaced_and_fails_the_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    crashed, killed = _exited(3), _exited(0)
    said: list[str] = []
    campaign = Campaign(FaultCluster(env={}), 1, [], [], say=said.append)
    campaign.managers = [crashed, killed]
    campaign.ended.add(killed.pid)  # the campaign's own kill: no finding
    replaced: list[int] = []

    async def new_manager() -> None:
        replaced.append(1)

    monkeypatch.setattr(campaign, "_new_manager", new_manager)

    async def check() -> None:
        campaign.check_exits()
        campaign.check_exits()  # noted once
        await asyncio.gather(*campaign._tasks)

    asyncio.run(check())
    assert campaign.exits == [f"manager (pid {crashed.pid}) exited with code 3: "]
    assert replaced == [1]
    assert "EXITED ON ITS OWN" in said[-1]
    verdict = verdict_of([rec("run", O1, 1, 10, 1.0), rec("run", O2, 1, 20, 1.0)])
    assert verdict.passed
    verdict.exits = campaign.exits
    assert not verdict.passed
    assert verdict.promise_held  # a crash is reported on its own line, not as a broken promise
    assert verdict.lines()[1].startswith("EXITED ON ITS OWN manager")
    assert verdict.lines()[0].endswith("1 process(es) exited on their own")
    assert verdict.lines()[0].startswith("verdict: the orchestrator kept its promise")


class _Manager(BaseHTTPRequestHandler):
    """A manager in the middle of a leader kill: every answer a 503, the first creates too."""

    creates_refused = 2
    calls: list[str] = []

    def _answer(self, code: int, body: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        self.calls.append("POST")
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.calls.count("POST") <= self.creates_refused:
            self._answer(503, '{"detail": "no leader yet"}')
        else:
            self._answer(201, f'{{"id": "{O1}"}}')

    def do_DELETE(self) -> None:
        self.calls.append("DELETE")
        self._answer(503, '{"detail": "the database is unavailable"}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def manager_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Manager)
    _Manager.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_manager_answering_5xx_in_churn_is_retried_then_a_verdict_line_not_a_traceback(
    manager_port: int,
) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    manager = Proc("manager", subprocess.Popen(sleeper), None, port=manager_port)
    said: list[str] = []
    spec = ObserverSpec("ticker", {}, 1)
    campaign = Campaign(FaultCluster(env={}), 1, [], [spec], say=said.append, api_patience=1.0)
    campaign.managers = [manager]
    doomed = uuid.UUID(O2)
    campaign.live[doomed] = campaign.kinds[doomed] = "ticker"
    try:
        asyncio.run(campaign._churn(Planned(1.0, "churn", picks=(0.0,), creates=1)))
    finally:
        manager.popen.kill()
        manager.popen.wait()
    # The create's 503s were tried again until it was accepted.
    assert uuid.UUID(O1) in campaign.live
    # The delete was never accepted: noted, kept live, and a finding of the verdict.
    assert doomed in campaign.live
    assert _Manager.calls.count("DELETE") > 1
    assert len(campaign.api_failures) == 1
    assert campaign.api_failures[0].startswith(f"deleting {doomed}: 503 ")
    assert any("API FAILED: deleting" in line for line in said)
    verdict = verdict_of([rec("run", O1, 1, 10, 1.0), rec("run", O2, 1, 20, 1.0)])
    verdict.api_failures = campaign.api_failures
    assert not verdict.passed
    assert verdict.promise_held
    assert verdict.lines()[1].startswith(f"API FAILED deleting {doomed}")
    assert verdict.lines()[0].endswith("1 API call(s) failed")


def test_observers_are_given_as_kind_count_and_params() -> None:
    spec = parse_observer('ticker*5:{"interval": 0.1}')
    assert (spec.kind, spec.count, spec.params) == ("ticker", 5, {"interval": 0.1})
    assert parse_observer("recorder").count == 1
    for bad, message in [
        ("*3", "a kind name comes first"),
        ("ticker*x", "whole number"),
        ("ticker:{", "not JSON"),
        ("ticker:[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_observer(bad)


def test_the_witness_file_holds_every_record_and_lines_from_threads_stay_whole(
    tmp_path: Path,
) -> None:
    service = uuid.uuid4()
    w = Witness(tmp_path, service)
    oid = uuid.UUID(O1)
    w.ran(oid, 3)
    w.ran(oid, 3)  # within the resolution of the one before: not written

    def effects() -> None:
        for _ in range(200):
            w.effect(oid, 3, "write")

    threads = [threading.Thread(target=effects) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.stop(oid, 3, "cancelled")
    w.stall(oid, 3, 2.5)
    w.end(oid, 3)
    w.memory("leaky", 1000, 2)
    w.close()
    records = witness.read(tmp_path)
    kinds = [r.r for r in records]
    assert kinds.count("run") == 1
    assert kinds.count("fx") == 800
    assert {"stop", "stall", "end", "mem"} <= set(kinds)
    assert all(r.service == str(service) for r in records)
    assert next(r for r in records if r.r == "stall").detail["d"] == 2.5


def rec(r: str, o: str | None, e: int, p: int, t: float, **detail: object) -> Record:
    return Record(r, o, e, "svc", p, t, dict(detail))


def verdict_of(records: list[Record], **kw: Any) -> Verdict:
    args: dict[str, Any] = {
        "kinds": {O1: "k", O2: "k"},
        "live": {O1, O2},
        "deleted": {},
        "failed": {},
        "restarts": [],
        "alive": {10, 20},
        "shutdown_timeout": 5.0,
    }
    args.update(kw)
    return judge(records, **args)


def test_two_copies_at_once_are_an_overlap_and_one_after_the_other_is_not() -> None:
    moved = [
        rec("run", O1, 1, 10, 0.0),
        rec("run", O1, 1, 10, 1.0),
        rec("end", O1, 1, 10, 1.1),
        rec("run", O1, 2, 20, 1.2),
        rec("run", O2, 1, 20, 0.0),
    ]
    v = verdict_of(moved)
    assert v.overlaps == []
    assert v.lost == []
    assert v.passed
    # A thread of the first copy writes on after the observer moved.
    v = verdict_of([*moved, rec("fx", O1, 1, 10, 3.0, x="write"), rec("run", O1, 2, 20, 3.5)])
    (o,) = v.overlaps
    assert (o.observer, o.a.epoch, o.b.epoch) == (O1, 1, 2)
    assert o.seconds == pytest.approx(1.8)
    assert not v.passed
    lines = v.lines()
    assert lines[0] == (
        "verdict: the orchestrator BROKE its promise (1 overlap(s): two copies ran at once); "
        "every kind stopped in time"
    )
    assert any(line.startswith("OVERLAP k") for line in lines)


def test_one_step_cut_by_a_sigstop_is_shown_apart_and_a_second_is_an_overlap() -> None:
    """Process 10 is frozen from 1.0 to 9.0; epoch 2 runs O1 elsewhere from 6.0. The one step
    that was between its lease check and its resumption at the SIGSTOP completes at 9.01: it is
    shown, not an overlap. Anything more after that freeze is one."""
    frozen = {10: [(1.0, 9.0)]}
    records = [
        rec("run", O1, 1, 10, 0.0),
        rec("run", O1, 1, 10, 0.9),
        rec("run", O2, 1, 10, 0.9),
        rec("run", O1, 2, 20, 6.0),
        rec("run", O2, 2, 20, 6.0),
        rec("run", O1, 2, 20, 9.5),
        rec("run", O2, 2, 20, 9.5),
    ]
    cut = rec("run", O1, 1, 10, 9.01)
    v = verdict_of([*records, cut], paused=frozen, alive={20})
    assert v.overlaps == []
    assert v.passed
    (line,) = v.late_steps
    assert line.startswith(f"{O1}: epoch 1 in process 10 stepped once")
    assert any(x.startswith("STEP ACROSS A FREEZE") for x in v.lines())
    # Without the freeze on record, the same step is an overlap.
    assert len(verdict_of([*records, cut], alive={20}).overlaps) == 1
    # Two copies stepping after one freeze, or one copy stepping twice: overlaps.
    two = verdict_of([*records, cut, rec("run", O2, 1, 10, 9.02)], paused=frozen, alive={20})
    assert len(two.overlaps) == 2
    assert two.late_steps == []
    twice = verdict_of([*records, cut, rec("run", O1, 1, 10, 9.3)], paused=frozen, alive={20})
    assert len(twice.overlaps) == 1
    assert not twice.passed
    # A step long after the wake is not the cut one.
    later = verdict_of([*records, rec("run", O1, 1, 10, 9.0 + witness.THAW + 0.1)], paused=frozen)
    assert len(later.overlaps) == 1


def test_a_live_observer_without_a_running_copy_is_lost_unless_it_failed() -> None:
    records = [rec("run", O1, 1, 10, 0.0), rec("run", O2, 1, 30, 0.0)]  # process 30 is gone
    assert verdict_of(records).lost == [O2]
    assert f"LOST k {O2}: live, not running at the end" in verdict_of(records).lines()
    assert verdict_of(records, failed={O2: "boom"}).lost == []


def test_a_deleted_observer_must_not_start_again_nor_run_at_the_end() -> None:
    records = [
        rec("run", O1, 1, 10, 0.0),
        rec("stop", O1, 1, 10, 2.0, x="cancelled"),
        rec("end", O1, 1, 10, 2.1),
    ]
    ok = verdict_of(records, live={O2}, deleted={O1: 1}, alive={10})
    assert ok.ran_after_delete == []
    again = verdict_of([*records, rec("run", O1, 2, 10, 3.0)], live={O2}, deleted={O1: 1})
    assert again.ran_after_delete == [O1]
    running_on = verdict_of(records[:2], live={O2}, deleted={O1: 1}, alive={10})
    assert running_on.ran_after_delete == [O1]


def test_stops_are_timed_per_kind_and_a_copy_running_on_is_named() -> None:
    records = [
        rec("run", O1, 1, 10, 0.0),
        rec("stop", O1, 1, 10, 1.0, x="cancelled"),
        rec("end", O1, 1, 10, 1.25),
        rec("run", O2, 1, 10, 0.0),
        rec("stop", O2, 1, 10, 1.0, x="service stopping"),
        rec("run", O2, 1, 10, 9.0),
    ]
    v = verdict_of(records, live=set())
    k = v.kinds["k"]
    assert k.stops == [0.25]
    (ignored,) = k.ignored
    assert O2 in ignored
    assert "never ended" in ignored
    assert v.promise_held
    assert not v.stopped_in_time


def test_a_stop_waiting_on_its_commit_is_the_orchestrators_not_the_kinds() -> None:
    """The seconds a stop waited on the orchestrator's commit of the copy's checkpoint (``w``)
    are not the kind's: a stop slow only by them, or a copy given up on while in that write,
    is told apart; a copy given up on in its own code is the kind's."""
    o3 = "33333333-3333-3333-3333-333333333333"
    records = [
        rec("run", O1, 1, 10, 0.0),
        rec("stop", O1, 1, 10, 1.0, x="cancelled"),
        rec("end", O1, 1, 10, 10.0, w=8.5),
        rec("run", O2, 1, 10, 0.0),
        rec("stop", O2, 1, 10, 1.0, x="service stopping"),
        rec("hung", O2, 1, 10, 6.0, w=5.0),
        rec("run", o3, 1, 10, 0.0),
        rec("stop", o3, 1, 10, 1.0, x="service stopping"),
        rec("hung", o3, 1, 10, 6.0),
    ]
    v = verdict_of(records, live=set(), kinds={O1: "k", O2: "k", o3: "k"})
    k = v.kinds["k"]
    assert k.stops == [0.5]
    waited_o1, waited_o2 = k.waited_on_commit
    assert O1 in waited_o1
    assert "8.5s of them in the orchestrator's commit" in waited_o1
    assert O2 in waited_o2
    assert "gave up waiting" in waited_o2
    (ignored,) = k.ignored
    assert o3 in ignored
    assert any(line.startswith("STOP WAITED ON ITS COMMIT k:") for line in v.lines())


def test_a_copy_that_ended_before_its_service_gave_up_keeps_its_commit_wait() -> None:
    """Its code ended after a slow commit (a locked row); the service then gave up on its
    release and said so: the wait stays the orchestrator's (chaos seed 10 blamed the kind)."""
    records = [
        rec("run", O1, 1, 10, 0.0),
        rec("stop", O1, 1, 10, 1.0, x="service draining"),
        rec("end", O1, 1, 10, 3.8, w=2.8),
        rec("hung", O1, 1, 10, 5.8),
    ]
    v = verdict_of(records, live=set(), kinds={O1: "k"}, shutdown_timeout=2.0)
    assert not v.kinds["k"].ignored
    (waited,) = v.kinds["k"].waited_on_commit
    assert "2.8s of them in the orchestrator's commit" in waited


def test_stalls_name_the_observer_and_memory_growth_is_per_observer() -> None:
    records = [rec("run", O1, 1, 10, 0.0), rec("run", O2, 1, 10, 0.0)]
    records += [rec("stall", O1, 1, 10, 5.0, d=0.3), rec("stall", O2, 1, 10, 6.0, d=2.1)]
    # 2 copies, 1 MiB more each every 10 s after the warm-up: 6 MiB per observer per minute.
    records += [
        rec("mem", None, 0, 10, 10.0 + 10 * i, k="k", b=2 * (1 << 20) * i, n=2) for i in range(5)
    ]
    v = verdict_of(records)
    k = v.kinds["k"]
    assert (k.stalls, k.longest_stall, k.stalled_observer) == (2, 2.1, O2)
    assert k.growth == pytest.approx(6 * (1 << 20))
    assert k.growth is not None
    assert k.growth > GROWTH_FLAG
    lines = v.lines()
    assert any(line.startswith("STALL k") and O2 in line for line in lines)
    assert any(line.startswith("MEMORY GROWTH k") for line in lines)


def test_a_restart_spent_on_the_orchestrators_own_error_breaks_the_promise() -> None:
    records = [rec("run", O1, 1, 10, 0.0), rec("run", O2, 1, 10, 0.0)]
    assert verdict_of(records, restarts=[(O1, "RuntimeError: boom")]).passed
    v = verdict_of(records, restarts=[(O1, "DatabaseUnavailable: connection reset")])
    assert not v.promise_held


def test_a_witness_that_cannot_write_never_raises_into_kind_code(tmp_path: Path) -> None:
    w = Witness(tmp_path, uuid.uuid4())
    os.close(w._fd)
    w._fd = os.open("/dev/full", os.O_WRONLY)  # every write fails: no space left
    w.ran(uuid.UUID(O1), 1)
    w.effect(uuid.UUID(O1), 1, "write")
    w.hung(uuid.UUID(O1), 1)
    assert w.broken is not None
    assert "No space" in w.broken


async def test_the_guard_records_what_it_lets_through_not_what_it_throws_in(
    tmp_path: Path,
) -> None:
    w = Witness(tmp_path, uuid.uuid4())
    oid = uuid.UUID(O1)
    lost = asyncio.Event()

    def gate() -> asyncio.Future[None] | None:
        if lost.is_set():
            raise LeaseLost("gone")
        return None

    async def kind() -> None:
        for _ in range(1000):
            await asyncio.sleep(0.02)

    async def copy() -> None:
        await guarded(kind(), gate, Timing(StallWatch(10.0), "test", lambda _: None, oid, 4, w))

    task = asyncio.create_task(copy())
    await asyncio.sleep(0.1)
    before = [r for r in witness.read(tmp_path) if r.r == "run"]
    assert before
    lost.set()
    with pytest.raises(LeaseLost):
        await task
    after = [r for r in witness.read(tmp_path) if r.r == "run"]
    assert after == before  # the resumption that only raised LeaseLost is not a run


def test_memory_goes_to_the_kind_whose_lines_made_it() -> None:
    from observer_service.witnessing import attribute, source_of
    from orch_contracts.kinds import load_kinds

    kinds = load_kinds(["tests.support.bad_kinds"])
    sources: dict[str, list[tuple[int, int, str]]] = {}
    for name in ("leaky", "loop_blocker"):
        found = source_of(kinds[name])
        assert found is not None
        path, first, last = found
        sources.setdefault(path, []).append((first, last, name))
    tracemalloc.start(8)
    try:
        from tests.support import bad_kinds

        bad_kinds._kept.clear()
        coro = bad_kinds.leaky(FakeCtx(LeakyParams(leak=100_000, interval=0.0)))  # type: ignore[arg-type]
        for _ in range(20):
            with contextlib.suppress(StopIteration):
                coro.send(None)
        coro.close()
        held = attribute(tracemalloc.take_snapshot(), sources)
    finally:
        tracemalloc.stop()
        bad_kinds._kept.clear()
    assert held["leaky"] >= 19 * 100_000
    assert held["loop_blocker"] < 10_000  # the same file, other lines: none of it


class FakeCtx:
    def __init__(self, params: object) -> None:
        self.params = params

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kinds", "tests.support.bad_kinds", "--observer", "nope*2"], "unknown kind 'nope'"),
        (["--kinds", "tests.support.bad_kinds", "--observer", "leaky:{"], "not JSON"),
        (
            ["--kinds", "tests.support.bad_kinds", "--observer", 'leaky:{"leak": "x"}'],
            "invalid params for kind 'leaky'",
        ),
        (["--kinds", "tests.support.bad_kinds", "--faults", "kill,melt"], "unknown fault 'melt'"),
        (["--kinds", "no.such.module"], "cannot import kind module 'no.such.module'"),
    ],
)
def test_orch_verify_refuses_a_wrong_command_before_starting_anything(
    args: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    from orch.cli import app

    result = CliRunner().invoke(app, ["verify", *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_orch_verify_says_how_to_give_the_params_a_kind_requires(tmp_path: Path) -> None:
    """The README's ``price_watch`` requires ``symbol``: created by default with none, the
    refusal says how to give them (``--observer`` or ``--params``)."""
    from tests.unit.test_readme_kind import ROOT, readme_kind_example

    (tmp_path / "mykinds.py").write_text(readme_kind_example())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", COLUMNS="300")
    done = subprocess.run(
        [sys.executable, "-m", "orch", "verify", "--kinds", "mykinds", "--seconds", "60"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said
    assert "symbol: Field required" in said
    assert """--observer 'price_watch*3:{"symbol": "…"}'""" in said
    assert "--params FILE" in said


def test_outputs_are_judged_from_what_a_consumer_received() -> None:
    from orch_contracts.outputs import Output
    from orch_verify.outputs import judge_outputs

    a, b = uuid.uuid4(), uuid.uuid4()

    def out(o: uuid.UUID, seq: int, epoch: int = 1) -> Output:
        return Output(o, seq, epoch, "k", "n", 0.0, {})

    clean = [out(a, 1), out(a, 2), out(a, 2), out(a, 3, 2), out(b, 1)]
    f = judge_outputs(clean, {str(a): 3, str(b): 1})
    assert f.held
    assert f.repeats == {str(a): 1}
    assert f.received == 4
    # A committed seq never received, one that came after a higher one, a stale epoch's.
    bad = [out(a, 1), out(a, 3, 2), out(a, 2), out(a, 4, 1), out(b, 2)]
    f = judge_outputs(bad, {str(a): 4, str(b): 3})
    assert not f.held
    assert f.out_of_order == {str(a): [2]}
    assert f.stale == {str(a): [4]}
    assert f.gaps == {str(b): [(1, 1), (3, 3)]}
    lines = f.lines({str(a): "k", str(b): "k"})
    assert any(line.startswith(f"OUTPUT GAP k {b}: seq 1, 3") for line in lines)
    assert any(line.startswith("STALE OUTPUT") for line in lines)
    # A seq received again from another epoch: two records under one message id.
    conflicting = [out(a, 1), out(a, 2, 1), out(a, 2, 2), out(a, 3, 2)]
    g = judge_outputs(conflicting, {str(a): 3})
    assert not g.held
    assert g.conflicts == {str(a): [2]}
    assert any(line.startswith("OUTPUT CONFLICT k") for line in g.lines({str(a): "k"}))
    v = verdict_of([rec("run", O1, 1, 10, 0.0), rec("run", O2, 1, 20, 0.0)])
    v.outputs = f
    assert not v.passed
    assert v.lines()[0].startswith(
        "verdict: the orchestrator BROKE its promise (outputs not delivered once each in order)"
    )
