"""One ``orch verify`` run: a throw-away cluster with the user's kinds in verify mode, observers,
the seeded campaign, healing, the verdict and its reports."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from orch.cluster import Scratch, wait_for
from orch_contracts import witness
from orch_contracts.kinds import KindSpec, load_kinds
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import Topology
from orch_manager.auth import Role, new_token
from orch_verify.availability import CANNOT_TAKE, INPUTS, RECOVERY, Inputs, Lives
from orch_verify.campaign import Campaign, ObserverSpec, Planned, plan
from orch_verify.cluster import FaultCluster
from orch_verify.judge import Verdict, copies_of, judge, running_at_end
from orch_verify.outputs import OutputFindings, OutputWatch, judge_outputs
from orch_verify.report import html_report, table


@dataclass
class Options:
    kind_modules: list[str]
    observers: list[ObserverSpec]
    seconds: float
    seed: int
    weights: dict[str, float]
    every: float = 0.9
    services: int = 3
    worker_count: int = 40
    shutdown_timeout: float = 10.0
    #: Seconds the cluster gets after healing to run every live observer again.
    settle: float = 60.0
    json_path: Path | None = None
    report_path: Path | None = None
    #: Keep the processes' logs and the witness files here (else a temporary directory).
    workdir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    verdict: Verdict
    campaign: Campaign
    records: list[witness.Record]


async def campaign_on(
    cluster: FaultCluster,
    options: Options,
    witness_dir: Path,
    say: Callable[[str], None],
    alongside: Callable[[Campaign], Coroutine[Any, Any, None]] | None = None,
) -> Outcome:
    """Run the campaign on ``cluster`` (its processes write their witness to ``witness_dir``)
    and judge it; ``alongside`` runs from the cluster's start to the faults' healing (the
    soak's samples). The cluster's processes are left for its owner to stop."""
    schedule = plan(
        options.seed,
        options.seconds,
        options.weights,
        every=options.every,
        slots=options.services,
    )
    say(
        f"seed {options.seed}: {len(schedule)} faults over {options.seconds:.0f}s, schedule "
        f"{digest(schedule)} (the same seed and options replay it)"
    )
    campaign = Campaign(
        cluster,
        options.seed,
        schedule,
        options.observers,
        services=options.services,
        worker_count=options.worker_count,
        say=say,
    )
    watch = OutputWatch(cluster.env["ORCH_AMQP_URL"], Topology(cluster.env["ORCH_PREFIX"]))
    beside: asyncio.Task[None] | None = None
    try:
        await watch.start()  # bound before the first observer is created
        await campaign.start()
        if alongside is not None:
            beside = asyncio.create_task(alongside(campaign), name="alongside")
        await campaign.run(options.seconds)
        await campaign.heal()
        if beside is not None:
            beside.cancel()
            await asyncio.gather(beside, return_exceptions=True)
        verdict, records = await _settle_and_judge(cluster, campaign, witness_dir, options)
        verdict.outputs = await _judge_outputs(cluster, watch)
    finally:
        if beside is not None:
            beside.cancel()
        await campaign.close()
        await watch.close()
    return Outcome(verdict, campaign, records)


async def _judge_outputs(cluster: FaultCluster, watch: OutputWatch) -> OutputFindings:
    """What the consumer got of every record committed by now, once it all arrived or 30 s on.

    The observers go on emitting meanwhile: what they commit after this moment is in flight,
    not missing, so the gaps are judged against the seqs committed when the wait began."""
    rows = await cluster.q("SELECT id, output_seq FROM observers WHERE output_seq > 0")
    committed = {str(r["id"]): int(r["output_seq"]) for r in rows}

    async def arrived() -> bool:
        return all(watch.received_up_to(o, n) for o, n in committed.items())

    with contextlib.suppress(TimeoutError):
        await wait_for(arrived, timeout=30, what="every committed output received", every=0.5)
    return judge_outputs(list(watch.outputs), committed)


async def verify(settings: CommonSettings, options: Options, console: Console) -> Outcome:
    """A throw-away cluster, the campaign, the verdict printed and written; the cluster, its
    database and its broker names are gone when this returns."""
    scratch = Scratch(settings.database_url, settings.amqp_url, "verify")
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="orch-verify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    witness_dir = workdir / "witness"
    # A token of its own: the cluster never uses the tokens of the environment it runs in.
    token, entry = new_token("orch-verify", Role.ADMIN)
    cluster: FaultCluster | None = None
    try:
        await scratch.prepare()
        cluster = FaultCluster(
            token=token,
            env={
                "ORCH_DATABASE_URL": await scratch.database("run"),
                "ORCH_AMQP_URL": settings.amqp_url,
                "ORCH_PREFIX": scratch.prefix("run"),
                "ORCH_LEASE_TTL": str(settings.lease_ttl),
                "ORCH_KIND_MODULES": ",".join(options.kind_modules),
                "ORCH_WITNESS_DIR": str(witness_dir),
                "ORCH_SHUTDOWN_TIMEOUT": str(options.shutdown_timeout),
                "ORCH_BROKER_ADVICE": "false",
                "ORCH_API_TOKENS": entry,
                "ORCH_AUTH": "on",
                **options.env,
            },
            logdir=workdir,
        )
        outcome = await campaign_on(
            cluster,
            options,
            witness_dir,
            lambda line: console.print(f"[dim]{escape(line)}[/dim]", highlight=False),
        )
    finally:
        try:
            if cluster is not None:
                await cluster.stop()
        finally:
            await scratch.cleanup()
            if options.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    verdict, campaign = outcome.verdict, outcome.campaign
    for line in verdict.lines():
        style = "green" if line.startswith("verdict") and verdict.passed else "red"
        console.print(f"[{style}]{escape(line)}[/{style}]", highlight=False)
    console.print(table(verdict))
    if options.json_path is not None:
        doc = {
            "seed": options.seed,
            "seconds": options.seconds,
            "schedule": digest(campaign.schedule),
            "first_overlap_seconds": (
                min(o.b.first for o in verdict.overlaps) - campaign.wall0 - campaign.began
                if verdict.overlaps
                else None
            ),
            "faults": [e.__dict__ for e in campaign.events],
            "verdict": verdict.as_dict(),
        }
        options.json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        console.print(f"JSON written to {options.json_path}")
    if options.report_path is not None:
        options.report_path.parent.mkdir(parents=True, exist_ok=True)
        options.report_path.write_text(html_report(verdict, campaign, options.seed))
        console.print(f"report written to {options.report_path}")
    return outcome


async def _settle_and_judge(
    cluster: FaultCluster, campaign: Campaign, witness_dir: Path, options: Options
) -> tuple[Verdict, list[witness.Record]]:
    live = {str(o) for o in campaign.live}
    deleted = {str(o) for o in campaign.deleted}

    async def failed_now() -> dict[str, str]:
        rows = await cluster.q("SELECT id, last_error FROM observers WHERE status = 'failed'")
        return {str(r["id"]): r["last_error"] or "" for r in rows}

    reader = witness.Reader(witness_dir)

    async def settled() -> bool:
        campaign.check_exits()
        records = await asyncio.to_thread(reader.read)
        running = running_at_end(copies_of(records), campaign.alive_pids())
        failed = await failed_now()
        return live <= running | set(failed) and not (deleted & running)

    # Settled, and still settled a second later: a copy that should not run gets that moment to
    # show itself, and a copy that stopped in it (a kind that blocks the loop costs its service
    # the lease again) is waited for, not judged lost. Past ``settle`` seconds it is judged as
    # it is: what is missing then is lost.
    deadline = time.monotonic() + options.settle
    while True:
        with contextlib.suppress(TimeoutError):
            await wait_for(
                settled,
                timeout=max(1.0, deadline - time.monotonic()),
                what="every live observer running",
                every=1,
            )
        await asyncio.sleep(1.0)
        if time.monotonic() >= deadline or await settled():
            break
    records = list(await asyncio.to_thread(reader.read))
    failed = await failed_now()
    restarts = await cluster.q(
        "SELECT observer_id, detail FROM observer_events WHERE event IN ('restarted', 'failed')"
    )
    kinds = {str(o): k for o, k in campaign.kinds.items()}
    verdict = judge(
        records,
        kinds=kinds,
        live=live,
        deleted={str(o): epoch for o, epoch in campaign.deleted.items()},
        failed=failed,
        restarts=[(str(r["observer_id"]), r["detail"] or "") for r in restarts],
        alive=campaign.alive_pids(),
        shutdown_timeout=options.shutdown_timeout,
        paused=campaign.paused,
    )
    verdict.zero = campaign.wall0 + campaign.began
    inputs = await _availability(cluster, campaign, options, verdict.zero)
    inputs.save(witness_dir.parent / INPUTS)  # python -m orch_verify.availability judges again
    verdict.availability = inputs.judge(records)
    campaign.check_exits()
    verdict.names = dict(campaign.processes)
    verdict.exits = list(campaign.exits)
    verdict.api_failures = list(campaign.api_failures)
    judged = (
        {o.observer for o in verdict.overlaps}
        | {g.observer for g in verdict.availability.unavailable}
        | {s.observer for s in verdict.availability.late_stops}
    )
    for observer in judged:
        rows = await cluster.q(
            "SELECT extract(epoch FROM e.at) AS at, e.event, e.epoch, s.name, e.detail "
            "FROM observer_events e LEFT JOIN services s ON s.id = e.service_id "
            "WHERE e.observer_id = $1 ORDER BY e.id",
            uuid.UUID(observer),
        )
        verdict.history[observer] = [
            f"{float(r['at']) - campaign.wall0:7.2f}s {r['event']} epoch {r['epoch']} "
            f"{r['name'] or ''} {r['detail'] or ''}".rstrip()
            for r in rows
        ]
    verdict.broken = [
        f"{p.name} (pid {p.pid})" for p in cluster.procs if witness.BROKEN in p.tail(100_000)
    ]
    return verdict, records


async def _availability(
    cluster: FaultCluster, campaign: Campaign, options: Options, zero: float
) -> Inputs:
    """What the second half of the promise is judged on (``orch_verify/availability.py``),
    besides the witness: the faults applied, the observers' lives, their own restarts and
    where the database placed each observer (taken by, or directed to)."""
    end = time.time()
    events = await cluster.q(
        "SELECT e.observer_id, e.event, extract(epoch FROM e.at) AS at, s.pid "
        "FROM observer_events e LEFT JOIN services s ON s.id = e.service_id "
        "WHERE e.event IN ('restarted', 'failed', 'taken', 'redispatched') ORDER BY e.at"
    )
    restarts: dict[str, list[float]] = {}
    failed: dict[str, float] = {}
    placed: dict[str, list[tuple[float, int]]] = {}  # taken by, or directed to
    for e in events:
        oid = str(e["observer_id"])
        if e["event"] in ("taken", "redispatched"):
            if e["pid"] is not None:
                placed.setdefault(oid, []).append((float(e["at"]), int(e["pid"])))
            continue
        if e["event"] == "failed":
            failed.setdefault(oid, float(e["at"]))
        restarts.setdefault(oid, []).append(float(e["at"]))
    specs = load_kinds(options.kind_modules)
    ttl = float(cluster.env.get("ORCH_LEASE_TTL", "5"))
    renew = float(cluster.env.get("ORCH_RENEW_INTERVAL", str(ttl / 5)))
    lives = Lives(
        created={str(o): t for o, t in campaign.created_at.items()},
        deleted={str(o): t for o, t in campaign.deleted_at.items()},
        delete_sent={str(o): t for o, t in campaign.delete_sent.items()},
        failed=failed,
        restarts=restarts,
        policies={name: spec.restart_policy for name, spec in specs.items()},
        takers={pid: (a, b) for pid, (a, b) in campaign.takers.items()},
        paused=_not_taking(campaign, ttl),
        placed=placed,
    )
    return Inputs(
        kinds={str(o): k for o, k in campaign.kinds.items()},
        lives=lives,
        faults=list(campaign.faults),
        ttl=ttl,
        renew_interval=renew,
        end=end,
        shutdown_timeout=options.shutdown_timeout,
        zero=zero,
    )


def _not_taking(campaign: Campaign, ttl: float) -> dict[int, list[tuple[float, float]]]:
    """Per service process, when it could not take work promptly though it lived: frozen, or
    its broker or database link cut, reset or slow (until ``RECOVERY`` after). One frozen past
    its lease takes nothing until ``RECOVERY`` after it thawed either: it fences, releases
    what it held and joins again on a new session (and its broker connection, declared dead
    meanwhile, opens anew) first."""
    out = {
        pid: [(a, b + RECOVERY if b - a > ttl else b) for a, b in windows]
        for pid, windows in campaign.paused.items()
    }
    for f in campaign.faults:
        if f.name in CANNOT_TAKE and f.pid is not None:
            out.setdefault(f.pid, []).append((f.start, f.end + RECOVERY))
    return out


def digest(schedule: list[Planned]) -> str:
    """A short fingerprint of a schedule, to compare two runs at a glance."""
    return hashlib.sha256(repr(schedule).encode()).hexdigest()[:12]


def params_hint(spec: KindSpec, count: int) -> str:
    """How to give ``spec``'s params to ``orch verify``, its required ones named: for a kind
    created by default, with none."""
    if spec.params_model is not None:
        fields = spec.params_model.model_fields
        required = [f.alias or name for name, f in fields.items() if f.is_required()]
    else:
        required = list((spec.params_schema or {}).get("required", []))
    example = json.dumps({name: "…" for name in required}, ensure_ascii=False)
    return (
        f"give them with --observer '{spec.name}*{count}:{example}', or --params FILE (a JSON"
        f' object {{"{spec.name}": {{…}}}}, for the kinds created by default)'
    )


def parse_observer(text: str) -> ObserverSpec:
    """``KIND``, ``KIND*COUNT``, ``KIND:PARAMS_JSON`` or ``KIND*COUNT:PARAMS_JSON``."""
    head, sep, params_text = text.partition(":")
    kind, star, count_text = head.partition("*")
    kind = kind.strip()
    if not kind:
        raise ValueError(f"{text!r}: a kind name comes first (KIND[*COUNT][:PARAMS_JSON])")
    try:
        count = int(count_text) if star else 1
    except ValueError:
        raise ValueError(f"{text!r}: the count after * must be a whole number") from None
    if not 1 <= count <= 10_000:
        raise ValueError(f"{text!r}: the count must be between 1 and 10000")
    params: Any = {}
    if sep:
        try:
            params = json.loads(params_text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{text!r}: the params are not JSON ({exc})") from None
        if not isinstance(params, dict):
            raise ValueError(f"{text!r}: the params must be a JSON object")
    return ObserverSpec(kind, params, count)


def new_seed() -> int:
    return secrets.randbelow(1_000_000)
