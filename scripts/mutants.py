"""Every fence proven necessary: apply each mutant (a fence or check removed), run the tests that
should catch it, and expect them to fail. Run by hand (``scripts/mutants``), not by
``scripts/test``: it takes a few minutes. Exit code 1 if any mutant survives.

With ``--verify SECONDS``, each mutant is judged by ``orch verify`` instead: a campaign of that
length over recorders and late writers (seed ``--seed``, default 7; faults ``--faults``, as
``orch verify`` takes them, default all), caught when the verdict finds an overlap, a lost
observer, a deleted one running on, a failed one or a process of the orchestrator that exited
on its own. It prints when the first overlap began.

The mutants are applied to the files of this checkout: run it from a checkout nobody edits
meanwhile (``git worktree add``).

Usage: python scripts/mutants.py [--verify SECONDS [--seed N] [--faults F]] [NAME ...]
(no name: all)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCES = "tests/integration/test_fences.py"
CORE = "tests/unit/test_service_core.py"
GUARD = "tests/unit/test_deadline_and_guard.py"
FAULTS = "tests/acceptance/test_faults.py"
ONCE = "tests/acceptance/test_exactly_once.py"
BROKER = "tests/acceptance/test_broker.py"
OUTPUTS_CORE = "tests/unit/test_outputs_core.py"
CONTRACT = "tests/integration/test_store_contract.py"
OUTPUTS = "tests/acceptance/test_outputs.py"
LEADER = "tests/integration/test_leader_fence.py"
PLACEMENT = "tests/integration/test_leader_placement.py"
TAKE = "tests/unit/test_take.py"
SWEEPER = "tests/integration/test_sweeper.py"
ALWAYS = "tests/acceptance/test_always_running.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    # ------------------------------------------------------------ always one copy running
    Mutant(
        "take: a start whose dispatch was replaced never runs an observer nobody runs",
        "observer_service/take.py",
        "    if facts.status not in (ObserverStatus.CREATED, ObserverStatus.PROCESSING):\n"
        "        return False\n    if not facts.belongs_here:",
        "    if True:\n        return False\n    if not facts.belongs_here:",
        (
            f"{TAKE}::test_a_stale_start_runs_an_observer_nobody_runs",
            f"{CONTRACT}::test_a_stale_dispatch_runs_an_observer_nobody_runs_and_only_that",
        ),
    ),
    Mutant(
        "deliveries: a copy whose session ended stays marked as holding a delivery",
        "observer_service/service.py",
        "        self.marks.lost(r.copy for r in lost)",
        "        self.marks.lost([])",
        (f"{CORE}::test_a_copy_whose_session_ended_is_marked_as_holding_no_delivery",),
    ),
    Mutant(
        "sweeper: a gone service's requeue waited for while anything is taken",
        "manager/background.py",
        "        return [s for s, (_, since) in self.requeues.items() "
        "if now - since < self.requeue_grace]",
        "        return list(self.requeues)",
        (f"{SWEEPER}::test_a_requeue_stuck_at_a_frozen_consumer_waits_no_longer_than_the_grace",),
    ),
    Mutant(
        "audit: starts a live service is taking are sent anew",
        "manager/queries.py",
        '   AND NOT EXISTS (SELECT 1 FROM services s WHERE {live_service("s")} '
        "AND o.id = ANY(s.taking))\n",
        "",
        (f"{PLACEMENT}::test_the_audit_leaves_alone_what_a_live_service_is_taking",),
    ),
    Mutant(
        "audit: a start directed to a live service is sent anew within the grace",
        "manager/queries.py",
        "            AND o.modified_at > now() - make_interval(secs => :directed)\n",
        "            AND false\n",
        (f"{PLACEMENT}::test_the_audit_leaves_a_start_directed_to_a_live_service_to_it",),
    ),
    Mutant(
        "audit: nothing is placed while the broker cannot be asked",
        "manager/background.py",
        "        with contextlib.suppress(BrokerUnavailable):\n            ready = {",
        "        if True:\n            ready = {",
        (
            f"{PLACEMENT}::"
            "test_the_audit_places_stuck_observers_through_the_database_while_the_broker_is_away",
        ),
    ),
    Mutant(
        "service: an absent broker tried again only every 5 s",
        "observer_service/service.py",
        "        backoff = Backoff(0.05, 1.0, jitter=0.5)",
        "        backoff = Backoff(0.05, 5.0, jitter=0.5)",
        (f"{BROKER}::test_a_service_is_back_on_the_broker_soon_after_it_returns",),
    ),
    Mutant(
        "lease: the join's statement parsed after the lease's clock started",
        "observer_service/lease.py",
        "        await session.prepare_join()\n        sent = self.clock.now()\n",
        "        sent = self.clock.now()\n        await session.prepare_join()\n",
        (f"{CORE}::test_the_leases_clock_starts_once_the_join_is_parsed",),
    ),
    Mutant(
        "join: a death proven earlier stays on the row of a service that came back",
        "observer_service/queries.py",
        "rejoined_at = clock_timestamp(), gone_at = NULL\n",
        "rejoined_at = clock_timestamp()\n",
        (
            f"{SWEEPER}::test_a_service_back_after_it_was_proven_gone_is_not_left_to_a_requeue_later",
        ),
    ),
    Mutant(
        "renewal: the takes in flight are not reported",
        "observer_service/lease.py",
        "            taking=self.listener.taking(),\n",
        "",
        (f"{CORE}::test_the_renewals_report_the_takes_in_flight",),
    ),
    Mutant(
        "renewal: observers directed here are never taken from the database",
        "observer_service/service.py",
        "            self._directed_by_database(renewal.directed)\n",
        "",
        (f"{CORE}::test_an_observer_directed_here_whose_start_never_came_is_taken_at_a_renewal",),
    ),
    Mutant(
        "stop: the holder read as gone whatever the take made of the row",
        "manager/repository.py",
        "    live = sid is not None and bool(await tx.value(q.HOLDER_LIVE, sid=sid))",
        "    live = False",
        (
            "tests/integration/test_stop_races.py::"
            "test_a_stop_waiting_on_a_take_sees_the_new_holder_and_broadcasts_its_cancel",
        ),
    ),
    Mutant(
        "headroom: the process running out of files is the kind's error, restarted in place",
        "observer_service/runner.py",
        "            if resource_error(exc):",
        "            if False:",
        (f"{CORE}::test_a_copy_out_of_the_processs_files_moves_on_spending_one_restart",),
    ),
    Mutant(
        "headroom: a kind that exhausts its service moves for ever",
        "observer_service/runner.py",
        "                if (await record_error(error)).failed:\n"
        "                    return error\n",
        "",
        (f"{CORE}::test_a_kind_that_keeps_exhausting_its_service_fails_with_its_budget",),
    ),
    Mutant(
        "held check: a copy whose row is not ours runs on",
        "observer_service/service.py",
        "        if every or held < len(running):",
        "        if False:",
        (f"{CORE}::test_a_copy_whose_row_is_not_ours_is_stopped_even_if_it_never_writes",),
    ),
    Mutant(
        "runner: a settled copy keeps its ended task (freed by a full collection only)",
        "observer_service/service.py",
        "            runner.finished.set()\n            runner.forget()",
        "            runner.finished.set()",
        (f"{CORE}::test_an_ended_copy_is_freed_at_once_not_by_a_full_collection",),
    ),
    Mutant(
        "publisher: the leader's questions asked on the publishing connection",
        "manager/publisher.py",
        "        return lookout\n",
        "        return self._connection  # type: ignore[return-value]\n",
        (
            f"{PLACEMENT}::test_the_leaders_questions_are_answered_while_the_broker_blocks_its_publishes",
            f"{ALWAYS}::test_failover_runs_through_a_memory_alarm",
        ),
    ),
    Mutant(
        # Checkpoints, releases and deletes find their rows the same way (``_MY_BATCH``).
        "batch writes (checkpoint, release, delete): no epoch predicate",
        "observer_service/queries.py",
        'IS TRUE AND $3::jsonb ? {_COPY}"',
        "IS TRUE AND EXISTS (SELECT FROM jsonb_object_keys($3::jsonb) k "
        "WHERE split_part(k, ':', 1) = o.id::text)\"",
        (
            f"{FENCES}::test_a_stale_checkpoint_is_refused",
            f"{FENCES}::test_a_stale_release_is_refused",
            f"{FENCES}::test_a_stale_delete_is_refused",
        ),
    ),
    Mutant(
        "checkpoint batch: one entry per observer",
        "observer_service/store.py",
        "newest = {(c.observer_id, c.epoch): c for c in items}",
        "newest = {c.observer_id: c for c in items}",
        (f"{FENCES}::test_a_stale_checkpoint_is_refused",),
    ),
    Mutant(
        "restart record: no epoch predicate",
        "observer_service/queries.py",
        "WHERE id = $1 AND epoch = $3 AND service_id = $2 AND {sql_in",
        "WHERE id = $1 AND service_id = $2 AND {sql_in",
        (f"{FENCES}::test_a_stale_restart_record_is_refused",),
    ),
    Mutant(
        "failed: no epoch predicate",
        "observer_service/queries.py",
        'f"modified_at = now() WHERE id = $1 AND epoch = $3 AND service_id = $2 "',
        'f"modified_at = now() WHERE id = $1 AND service_id = $2 "',
        (f"{FENCES}::test_a_stale_failure_is_refused",),
    ),
    Mutant(
        "take: no compare-and-set",
        "observer_service/queries.py",
        "   AND (o.epoch = ({v} ->> 'epoch')::bigint"
        " AND o.dispatch_id = ({v} ->> 'dispatch_id')::uuid\n"
        "        AND o.status = {v} ->> 'status'\n"
        "        AND o.service_id IS NOT DISTINCT FROM ({v} ->> 'holder')::uuid\n"
        "        AND o.pool = {v} ->> 'pool'\n"
        "        AND o.kind_version IS NOT DISTINCT FROM {v} ->> 'kind_version') IS TRUE",
        "   AND true",
        (
            f"{FENCES}::test_a_take_that_lost_the_race_is_refused",
            f"{FENCES}::test_concurrent_takes_have_one_winner",
        ),
    ),
    Mutant(
        "take: no lease-expiry check",
        "observer_service/queries.py",
        'COALESCE({live_service("s")}, false) AS holder_live',
        "COALESCE(NOT s.is_deleted, false) AS holder_live",
        (f"{FENCES}::test_a_holder_whose_lease_expired_is_taken_over",),
    ),
    Mutant(
        "renewal: no expiry check",
        "observer_service/queries.py",
        " WHERE id = $1 AND NOT is_deleted AND lease_expires_at > clock_timestamp()\nRETURNING",
        " WHERE id = $1\nRETURNING",
        (f"{FENCES}::test_a_renewal_never_revives_an_expired_lease",),
    ),
    Mutant(
        "self-fencing: the deadline never fences",
        "observer_service/lease.py",
        "        if not self._fenced and not self.deadline.valid():\n            self.fence",
        "        if False:\n            self.fence",
        (
            f"{CORE}::test_reading_the_lease_is_pure_and_its_own_schedule_fences",
            f"{CORE}::test_a_suspend_past_the_lease_fences",
            f"{ONCE}::test_freeze_longer_than_the_lease",
        ),
    ),
    Mutant(
        "self-fencing: the deadline without its margin",
        "contracts/deadline.py",
        "self.until = sent + self.timings.ttl - self.timings.margin",
        "self.until = sent + self.timings.ttl + self.timings.margin",
        ("tests/unit/test_deadline_and_guard.py",),
    ),
    Mutant(
        "self-fencing: a lost lease stops nothing",
        "observer_service/service.py",
        "        self._stop_where(lambda r: True, StopReason.LEASE_LOST)\n        self._lease_lost",
        "        self._lease_lost",
        (f"{CORE}::test_a_lost_lease_stops_even_a_copy_that_waits_long",),
    ),
    Mutant(
        "take rule: a redelivery taken without proof the holder is gone",
        "observer_service/take.py",
        "    if not facts.holder_lock_free:\n        return Decision.WAIT",
        "    if not facts.holder_lock_free:\n        return Decision.TAKE",
        ("tests/unit/test_take.py", f"{FAULTS}::test_dropped_lease_session_never_runs_two_copies"),
    ),
    Mutant(
        "take rule: a free lock trusted alone",
        "observer_service/take.py",
        "    if facts.holder_off_broker is None:\n        return Decision.PROBE",
        "    if facts.holder_off_broker is None:\n        return Decision.TAKE",
        (
            "tests/unit/test_take.py",
            f"{FENCES}::test_a_free_lock_alone_does_not_let_a_holder_be_taken_over",
        ),
    ),
    Mutant(
        "lease session ended: copies do not pause",
        "observer_service/lease.py",
        "        return LeaseState.STALE if self._bridging or self.deadline.stale() else",
        "        return LeaseState.STALE if self.deadline.stale() else",
        (f"{CORE}::test_an_ended_lease_session_pauses_copies_until_a_new_one_shows_them_ours",),
    ),
    Mutant(
        "take: one nobody waits for any more is kept (held, nothing running it)",
        "observer_service/intake.py",
        "            answer.add_done_callback(self._release_unawaited)",
        "            pass",
        (f"{CORE}::test_a_take_whose_delivery_callback_was_cancelled_is_released_at_once",),
    ),
    Mutant(
        "lease session ended: copies taken meanwhile resume",
        "observer_service/lease.py",
        "            self.listener.superseded(taken, held)",
        "            pass",
        (
            f"{CORE}::test_a_copy_taken_while_the_lease_session_was_down_never_resumes",
            f"{BROKER}::test_a_partition_then_a_lost_lease_session_runs_one_copy",
        ),
    ),
    Mutant(
        "departure proof: a take ignores the key it found free",
        "observer_service/queries.py",
        "   AND ({v} ->> 'holder_key' IS NULL\n",
        "   AND (true\n",
        (f"{FENCES}::test_a_takeover_lands_only_while_the_holder_keeps_the_key_found_free",),
    ),
    Mutant(
        "departure proof: the holder trusts its own list instead of reading its rows",
        "observer_service/lease.py",
        "        held = await session.held(",
        "        held = self.listener.copies() and before or await session.held(",
        (f"{CORE}::test_a_copy_taken_while_the_lease_session_was_down_never_resumes",),
    ),
    Mutant(
        "broker: a closed session stops its copies",
        "observer_service/service.py",
        "            self.metrics.channel_closes.labels(session.close_reason).inc()",
        "            self.metrics.channel_closes.labels(session.close_reason).inc()\n"
        "            self._stop_where(lambda r: True, StopReason.LEASE_LOST)",
        (f"{CORE}::test_a_closed_broker_session_stops_no_copy_and_its_redelivery_is_adopted",),
    ),
    Mutant(
        "intake: a take's database error leaves the start unsettled",
        "observer_service/intake.py",
        "                result = await while_leased(partial(self._submit_take, request), alive)",
        "                result = await self._submit_take(request)",
        (f"{CORE}::test_a_take_that_meets_a_database_error_is_retried_and_runs",),
    ),
    Mutant(
        "stalls: a stall past the lease is not blamed by the watchdog",
        "observer_service/stalls.py",
        "                    self._writes.blame(step.observer_id, reason)",
        "                    pass",
        (f"{BROKER}::test_a_kind_that_blocks_the_loop_is_failed_and_moves_its_neighbours_once",),
    ),
    Mutant(
        "take: a holder whose loop a kind blocks is taken over before its lease expires",
        "observer_service/queries.py",
        "            THEN s.stalled_since IS NULL AND pg_try_advisory_xact_lock(s.lock_key)",
        "            THEN pg_try_advisory_xact_lock(s.lock_key)",
        (
            "tests/integration/test_sweeper.py::"
            "test_a_stalled_service_is_not_taken_over_before_its_lease_expires",
        ),
    ),
    Mutant(
        "guard: a copy that lost its lease runs its cleanup",
        "observer_service/guard.py",
        "            except LeaseLost:\n                self._abandon()\n                raise",
        "            except LeaseLost as exc:\n                error = exc",
        (f"{CORE}::test_a_copy_whose_lease_is_lost_never_runs_its_cleanup",),
    ),
    Mutant(
        "suspend: deadlines on the monotonic clock",
        "contracts/clock.py",
        "            readings = self._read()",
        "            readings = (self.monotonic(),) * 4",
        (f"{FAULTS}::test_suspend_past_the_lease_fences",),
    ),
    Mutant(
        "guard: kind code resumes unchecked",
        "observer_service/guard.py",
        "                while (parked := gate()) is not None:",
        "                while (parked := None) is not None:",
        (
            f"{GUARD}::test_the_guard_abandons_the_kind_before_it_resumes_on_a_lost_lease",
            f"{CORE}::test_kind_code_never_resumes_after_the_lease_is_lost",
            f"{FAULTS}::test_frozen_copy_makes_no_side_effect_after_waking",
        ),
    ),
    Mutant(
        "reconcile: races a take in flight",
        "observer_service/service.py",
        "        async with self.admission.paused():\n            released",
        "        async with contextlib.nullcontext():\n            released",
        (f"{CORE}::test_reconcile_never_releases_a_take_in_flight",),
    ),
    Mutant(
        "graceful stop: releases copies that have not stopped",
        "observer_service/service.py",
        "        if hung:\n            self.clean = False",
        "        if False:\n            self.clean = False",
        (
            f"{CORE}::test_a_graceful_stop_never_releases_a_copy_that_has_not_stopped",
            f"{FAULTS}::test_shutdown_timeout_never_releases_a_running_copy",
        ),
    ),
    Mutant(
        "settle: the first stop reason decides the write",
        "contracts/statuses.py",
        'return f"CASE {column} {cases} ELSE {column} END"',
        "return column",
        (f"{FAULTS}::test_delete_during_handoff_ends_deleted",),
    ),
    Mutant(
        "sweeper: declares gone a service back on a new session",
        "manager/queries.py",
        '"AND NOT is_deleted AND stalled_since IS NULL AND pg_try_advisory_xact_lock(lock_key) "',
        '"AND NOT is_deleted AND stalled_since IS NULL "',
        (
            "tests/integration/test_sweeper.py::test_a_service_back_on_a_new_session_is_not_declared_gone",
        ),
    ),
    Mutant(
        "departure proof: one holder's proof covers any holder",
        "observer_service/take.py",
        "return key in self._ended, (True if key in self._gone else None)",
        "return bool(self._ended) or lock_free, (True if self._gone else None)",
        (f"{FENCES}::test_a_holder_back_on_a_new_session_is_not_covered_by_an_old_proof",),
    ),
    Mutant(
        "control: a drain or undrain acted on without the database's word",
        "observer_service/service.py",
        "        if facts.draining != drain:",
        "        if False:",
        (
            "tests/unit/test_control_checks.py::test_a_forged_drain_is_ignored_and_a_real_one_acted_on",
        ),
    ),
    Mutant(
        "control: a cancel acted on without the database's word",
        "observer_service/control.py",
        "    return (row.holder, row.epoch) != (me, copy.epoch)",
        "    return True",
        ("tests/unit/test_control_checks.py::test_a_forged_cancel_stops_nothing",),
    ),
    Mutant(
        "control: a handoff acted on whatever the leader recorded",
        "observer_service/control.py",
        "        and row.handoff_to == to\n",
        "\n",
        ("tests/unit/test_control_checks.py::test_a_forged_handoff_hands_nothing_over",),
    ),
    Mutant(
        "take: a recorded handoff survives the take",
        "observer_service/queries.py",
        '"handoff_to = NULL, committed_at = NULL, waiting = NULL, modified_at = now(), "',
        '"committed_at = NULL, waiting = NULL, modified_at = now(), "',
        (
            "tests/integration/test_store_contract.py::"
            "test_a_take_and_a_release_clear_a_recorded_handoff[postgresql]",
        ),
    ),
    Mutant(
        # The records of a write that was refused (a fenced copy's) go out all the same.
        "outputs: records are published whether or not their commit landed",
        "observer_service/outputs.py",
        "            if answer is True and item.records:\n",
        "            if item.records:\n",
        (f"{OUTPUTS_CORE}::test_the_records_of_a_refused_commit_are_never_published",),
    ),
    Mutant(
        # The copy key names the epoch: looked up by observer alone, every batch write (a
        # commit of records included) lands whatever epoch it carries.
        "batch writes and commits: the copy key without its epoch",
        "observer_service/queries.py",
        "_COPY = \"(o.id::text || ':' || o.epoch::text)\"",
        '_COPY = "(SELECT k FROM jsonb_object_keys($3::jsonb) k '
        "WHERE split_part(k, ':', 1) = o.id::text ORDER BY k LIMIT 1)\"",
        (
            f"{CONTRACT}::test_a_commit_gives_its_records_the_next_seqs_once_even_when_retried",
            f"{FENCES}::test_a_stale_checkpoint_is_refused",
        ),
    ),
    Mutant(
        "outputs: a copy reuses a seq (its last committed seq is not advanced)",
        "observer_service/outputs.py",
        "        self.last_seq = first - 1 + len(records)",
        "        self.last_seq = first - 1",
        (
            f"{OUTPUTS_CORE}::test_records_get_seqs_from_the_last_committed_and_reach_the_broker_in_order",
        ),
    ),
    Mutant(
        "leader fence: the lease read without a lock (a takeover does not wait)",
        "manager/queries.py",
        "expires_at > clock_timestamp()\n   FOR KEY SHARE",
        "expires_at > clock_timestamp()",
        (
            f"{LEADER}::test_an_old_leader_that_missed_its_lease_end_writes_nothing_in_its_successors_term",
            f"{LEADER}::test_a_takeover_waits_for_the_old_holders_open_transaction",
        ),
    ),
    Mutant(
        "sweeper: a gone service's queued observers left to the requeue for the grace alone",
        "manager/background.py",
        "                patience=self.requeue_patience,\n",
        "                patience=0.0,\n",
        (
            "tests/integration/test_sweeper.py::"
            "test_queued_observers_wait_while_their_services_requeue_is_worked_through",
        ),
    ),
    Mutant(
        "rebalance: the newest observers moved first",
        "manager/queries.py",
        '"ORDER BY started_at LIMIT :n"',
        '"ORDER BY started_at DESC LIMIT :n"',
        (f"{PLACEMENT}::test_rebalance_moves_the_observers_longest_without_a_move",),
    ),
    Mutant(
        "rebalance: a fleet within the tolerance evened out all the same",
        "manager/rebalance.py",
        "if not evening and balanced(loads, tolerance):",
        "if False:",
        (f"{PLACEMENT}::test_a_new_leader_leaves_a_fleet_within_the_tolerance_alone",),
    ),
    Mutant(
        "HTTP fence: a stale token let through to the receiver's app",
        "observer_service/sinks.py",
        "if seen is not None and found.epoch < seen:",
        "if False:",
        (
            "tests/integration/test_sinks.py::test_an_http_write_is_fenced_at_the_write_not_at_its_headers",
            "tests/acceptance/test_sinks_frozen.py::test_a_write_on_the_wire_of_a_frozen_copy_is_refused_by_the_store[http]",
        ),
    ),
]


def applied(mutant: Mutant, command: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``command`` in this checkout with ``mutant`` applied (restored whatever happens)."""
    path = ROOT / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        raise LookupError(f"the code to mutate is not found exactly once in {mutant.path}")
    started = time.monotonic()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    return result, time.monotonic() - started


def run(mutant: Mutant) -> tuple[bool, str, float]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    try:
        result, took = applied(mutant, [*command, *mutant.tests])
    except LookupError as exc:
        return False, str(exc), 0.0
    if result.returncode == 0:
        return False, "survived: every test passed", took
    if result.returncode != 1:
        return False, f"pytest exited {result.returncode}:\n{result.stdout[-2000:]}", took
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    return True, (failed[0] if failed else "failed").removeprefix("FAILED "), took


def run_verify(
    mutant: Mutant, seconds: float, seed: int, faults: str | None
) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "verdict.json"
        command = [
            *(sys.executable, "-m", "orch", "verify", "--kinds", "tests.support.kinds"),
            *("--observer", "recorder*20:" + json.dumps({"dir": tmp, "interval": 0.05})),
            *("--observer", "late_writer*10"),
            *("--seconds", str(seconds), "--seed", str(seed), "--json", str(out)),
            *("--report", str(Path(tmp) / "report.html")),
            *(("--faults", faults) if faults else ()),
        ]
        try:
            result, took = applied(mutant, command)
        except LookupError as exc:
            return False, str(exc), 0.0
        if not out.exists():
            output = result.stdout[-2000:] + result.stderr[-3000:]
            return False, f"orch verify exited {result.returncode}:\n{output}", took
        doc = json.loads(out.read_text())
    v = doc["verdict"]
    found = [
        f"{len(v['overlaps'])} overlaps" if v["overlaps"] else "",
        f"{len(v['lost'])} lost" if v["lost"] else "",
        f"{len(v['ran_after_delete'])} ran after delete" if v["ran_after_delete"] else "",
        f"{len(v['failed'])} failed" if v["failed"] else "",
        f"{len(v['own_error_restarts'])} restarts on our errors" if v["own_error_restarts"] else "",
        f"{len(v['exited_on_their_own'])} processes exited on their own"
        if v["exited_on_their_own"]
        else "",
    ]
    found = [f for f in found if f]
    if not found:
        return False, "survived: the verdict found nothing", took
    first = doc.get("first_overlap_seconds")
    when = f"; first overlap {first:.1f}s into the campaign" if first is not None else ""
    return True, ", ".join(found) + when, took


def option(args: list[str], name: str) -> str | None:
    """The value after ``name`` in ``args`` (both taken out), or None."""
    if name not in args:
        return None
    i = args.index(name)
    value = args[i + 1]
    del args[i : i + 2]
    return value


def main(args: list[str]) -> int:
    seed = int(option(args, "--seed") or 7)
    faults = option(args, "--faults")
    verify = option(args, "--verify")
    seconds = None if verify is None else float(verify)
    chosen = [m for m in MUTANTS if not args or m.name in args]
    survivors = 0
    for m in chosen:
        if seconds is None:
            killed, why, took = run(m)
        else:
            killed, why, took = run_verify(m, seconds, seed, faults)
        survivors += not killed
        print(
            f"{'killed  ' if killed else 'ALIVE   '} {m.name}  ({took:.0f} s)\n         {why}",
            flush=True,
        )
    print(f"\n{len(chosen) - survivors} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
