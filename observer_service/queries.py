"""Every SQL statement an observer service runs, in one place.

Each write for a running copy is one statement fenced by the copy's epoch and holder (it lands
only while both are still the row's), with its history rows inserted by the same statement.
Parameters: ``$2`` is always this service's id where a statement needs it.
"""

from __future__ import annotations

from collections.abc import Callable

from orch_contracts.durability import TIMELINE
from orch_contracts.errors import TRACEBACK_START
from orch_contracts.statuses import (
    HELD,
    LIVE,
    STOPPED,
    STOPPING,
    Event,
    ObserverStatus,
    held_by,
    live_service,
    sql_in,
    sql_stopped,
)

_PROCESSING = f"'{ObserverStatus.PROCESSING.value}'"
_FAILED = f"'{ObserverStatus.FAILED.value}'"


def _release_event(status_column: str) -> str:
    cases = " ".join(f"WHEN '{b.value}' THEN '{Event(b.value).value}'" for b in STOPPED.values())
    return f"CASE {status_column} {cases} ELSE '{Event.RELEASED.value}' END"


def _events(event: str, detail: str, service: str) -> str:
    return f"""e AS (INSERT INTO observer_events (observer_id, event, service_id, epoch, detail)
           SELECT u.id, {event}, {service}::uuid, u.epoch, {detail} FROM u)"""


def error_line(param: str) -> str:
    """A stored error's line, without its traceback (a history row keeps the line alone)."""
    return f"split_part({param}::text, E'\\n\\n{TRACEBACK_START[:-1]}\\n', 1)"


def with_events(update: str, event: str, detail: str, service: str = "$2") -> str:
    """``update`` (a statement returning ``id``, ``epoch`` and whatever it needs) plus one
    history row per updated observer. ``event`` and ``detail`` are SQL over the update's rows
    (``u``); a plain event is ``Event.X.sql``."""
    return f"""
WITH u AS ({update}),
     {_events(event, detail, service)}
SELECT * FROM u
"""


def skipping_locked(
    where: Callable[[str], str],
    set_: str,
    returning: str,
    *,
    events: tuple[str, str] | None = None,
) -> str:
    """A batched write that never waits for a row another transaction has locked: ``free``
    locks the target rows it can (SKIP LOCKED), only those are updated (``written`` true), and
    every target row as the statement's snapshot saw it follows (``written`` false). An item in
    both landed; one only in the second was skipped as locked (it is written again alone); one
    in neither is no longer ours (fenced).

    ``where(lock)`` selects the targets (observers ``o``), ``lock`` being the clause for any
    other row it locks; ``returning``: the extra columns of a written
    row (NULL in the others); ``events``: the history row (event, detail) of each written one."""
    extra = [c.strip() for c in returning.split(", ") if c.strip()]
    columns = "".join(f", {c}" for c in extra)
    nulls = ", NULL" * len(extra)
    history = f",\n     {_events(events[0], events[1], '$2')}" if events else ""
    return f"""
WITH free AS (SELECT o.id FROM observers o WHERE {where(_SKIP_SHARE)}
                 FOR NO KEY UPDATE OF o SKIP LOCKED),
     u AS (UPDATE observers o SET {set_}
            WHERE {where(_SKIP_SHARE)} AND o.id = ANY(ARRAY(SELECT free.id FROM free))
        RETURNING o.id, o.epoch{columns}){history}
SELECT u.*, true AS written FROM u
UNION ALL
SELECT o.id, o.epoch{nulls}, false FROM observers o WHERE {where("")}
"""


#: How a batched write locks a row besides its targets: without waiting either.
_SKIP_SHARE = "FOR SHARE SKIP LOCKED"


def event(e: Event) -> str:
    return f"'{e.value}'"


# ------------------------------------------------------------------------------------ take
# $1 observer ids, $2 me. A live holder keeps a session-level advisory lock for as long as its
# lease session lives; getting it (for this statement only) proves that session has ended. It
# never comes back: every session takes a new key, so the proof stays true afterwards.
FACTS = f"""
SELECT o.id, o.status, o.dispatch_id, o.service_id, o.epoch, o.name, o.kind, o.params,
       o.checkpoint, o.restart_policy, o.pool, o.kind_version,
       COALESCE({live_service("s")}, false) AS holder_live,
       CASE WHEN s.id <> $2 AND {live_service("s")}
            THEN s.stalled_since IS NULL AND pg_try_advisory_xact_lock(s.lock_key)
       END AS holder_lock_free,
       s.lock_key AS holder_key,
       EXTRACT(EPOCH FROM (s.lease_expires_at - clock_timestamp()))::float8 AS holder_remaining
  FROM observers o LEFT JOIN services s ON s.id = o.service_id
 WHERE o.id = ANY($1::uuid[])
"""

# $1 ids, $2 me, $3 what was seen of each row: {"<id>": {"epoch", "dispatch_id", "status",
# "holder", "detail", "holder_key", "pool", "kind_version", "queued", "take_dispatch"}},
# take_dispatch being the dispatch of the start a take runs (the row's from then on: a start
# whose dispatch was replaced may take an observer nobody runs), holder_key being the
# live holder's lock key found free (null unless taking from a live holder); pool and version
# too, since a move changes them without a new dispatch (a take decided before the move does not
# land); queued (a take's alone): the start came by a work-queue delivery, not directed.
# Looked up per row by key, like the batch writes below, so that the plan reads the batch's
# rows by primary key and never joins. The compare-and-set stands in for a row lock (the epoch
# is the row's version). A take from a live holder also holds only while the holder's row names
# the key found free: the FOR SHARE lock orders it with the holder's renewal on a new session
# (which publishes a new key), so either the take lands first and that holder's next look at
# its rows sees it, or the key has changed and the take does not land. That lock, like the
# observer rows, is taken SKIP LOCKED: a take never waits (nor makes the sweeper wait behind
# it); a row it skipped is LOCKED.
_AS_SEEN = "($3::jsonb -> o.id::text)"


def _seen(lock: str) -> str:
    v = _AS_SEEN
    return f"""o.id = ANY($1::uuid[])
   AND (o.epoch = ({v} ->> 'epoch')::bigint AND o.dispatch_id = ({v} ->> 'dispatch_id')::uuid
        AND o.status = {v} ->> 'status'
        AND o.service_id IS NOT DISTINCT FROM ({v} ->> 'holder')::uuid
        AND o.pool = {v} ->> 'pool'
        AND o.kind_version IS NOT DISTINCT FROM {v} ->> 'kind_version') IS TRUE
   AND ({v} ->> 'holder_key' IS NULL
        OR EXISTS (SELECT 1 FROM services s
                    WHERE s.id = ({v} ->> 'holder')::uuid
                      AND s.lock_key = ({v} ->> 'holder_key')::bigint {lock}))"""


# The next fencing token: one more, and above every token of the timelines before this one
# (a promotion raises the timeline: a failover that lost the last takes, with an asynchronous
# standby, never hands out a token lower than one a sink has seen). The first timeline's count
# from 1 as ever; a timeline holds 2^32 takes of an observer.
_NEXT_EPOCH = f"greatest(o.epoch + 1, ({TIMELINE} - 1) << 32)"

TAKE = skipping_locked(
    _seen,
    f"status = {_PROCESSING}, service_id = $2, epoch = {_NEXT_EPOCH}, started_at = now(), "
    f"dispatch_id = ({_AS_SEEN} ->> 'take_dispatch')::uuid, directed_to = NULL, "
    "handoff_to = NULL, committed_at = NULL, waiting = NULL, modified_at = now(), "
    f"queued_epoch = CASE WHEN ({_AS_SEEN} ->> 'queued')::boolean THEN {_NEXT_EPOCH} END",
    f"{_AS_SEEN} ->> 'detail' AS detail, o.checkpoint, o.output_seq",
    events=(event(Event.TAKEN), "u.detail"),
)
# Being deleted or paused and nobody runs it: complete the stop.
COMPLETE_STOP = skipping_locked(
    _seen,
    f"status = {sql_stopped('o.status')}, service_id = NULL, waiting = NULL, modified_at = now()",
    "o.status",
    events=(_release_event("u.status"), "'not running'"),
)

# $1 id, $2 dispatch id, $3 why: a start of another pool, or for a kind this service lacks,
# passed on to the leader (``waiting``), which sends it to a service of its pool that runs the
# kind. Only while that dispatch is
# current and no live service holds the observer (a holder that crashed is the sweeper's).
PASS_ON = f"""
UPDATE observers o SET waiting = $3, modified_at = now()
 WHERE o.id = $1 AND o.dispatch_id = $2 AND {sql_in("o.status", LIVE)}
   AND NOT EXISTS (SELECT 1 FROM services s WHERE s.id = o.service_id AND {live_service("s")})
RETURNING o.id
"""

# -------------------------------------------------------------------- writes of a running copy
# The rows of a batch ($1 ids), held by me ($2), each for one copy: $3 is a JSON object keyed
# "<id>:<epoch>" (``copy_key``), looked up per row by binary search. Found by primary key
# and never joined, whatever the statistics say. In bulk intake the table grows faster than
# ANALYZE runs; on stale statistics the planner took "service_id = me AND status IN (…)" for one
# row and read every row this service held for each batch (a 40-row checkpoint cost 25-130 ms
# at 10,000 held), and a join with the batch's arrays became a nested loop over both (a
# 1,000-row batch: a million comparisons, 0.2-2 s). Written as IS TRUE, those conditions are
# filters only; ``id = ANY($1)`` is the one way in (``store.SERVER_SETTINGS``).
_COPY = "(o.id::text || ':' || o.epoch::text)"
_MY_BATCH = (
    f"o.id = ANY($1::uuid[]) AND (o.service_id = $2) IS TRUE "
    f"AND ({sql_in('o.status', HELD)}) IS TRUE AND $3::jsonb ? {_COPY}"
)

# $1 ids, $2 me, $3 {"<id>:<epoch>": {"s": state (absent: unchanged), "r": [records], "q": the
# first record's seq}}. A commit lands where the row's output_seq is q - 1 (then it moves on by
# the records' count) or already q - 1 + count (the same commit, retried after its answer was
# lost: written again, its records inserted once). ``output_seq`` comes back: where it is not
# q - 1 + count the copy was out of step (a bug). The same shape as ``skipping_locked``.
_C = f"($3::jsonb -> {_COPY})"
_COUNT = f"jsonb_array_length(COALESCE({_C} -> 'r', '[]'::jsonb))"
_FIRST = f"({_C} ->> 'q')::bigint"
_IN_STEP = f"(o.output_seq = {_FIRST} - 1 OR o.output_seq = {_FIRST} - 1 + {_COUNT})"
COMMIT = f"""
WITH free AS (SELECT o.id FROM observers o WHERE {_MY_BATCH}
                 FOR NO KEY UPDATE OF o SKIP LOCKED),
     u AS (UPDATE observers o
              SET checkpoint = CASE WHEN {_C} ? 's' THEN {_C} -> 's' ELSE o.checkpoint END,
                  checkpointed_at = CASE WHEN {_C} ? 's' THEN clock_timestamp()
                                         ELSE o.checkpointed_at END,
                  output_seq = {_FIRST} - 1 + {_COUNT},
                  committed_at = clock_timestamp(), modified_at = now()
            WHERE {_MY_BATCH} AND {_IN_STEP} AND o.id = ANY(ARRAY(SELECT free.id FROM free))
        RETURNING o.id, o.epoch, o.output_seq, o.kind, o.name, {_C} -> 'r' AS records,
                  {_FIRST} AS first),
     ins AS (INSERT INTO observer_outputs (observer_id, seq, epoch, kind, name, records,
                                           service_id)
             SELECT u.id, u.first, u.epoch, u.kind, u.name, u.records, $2 FROM u
              WHERE jsonb_array_length(COALESCE(u.records, '[]'::jsonb)) > 0
             ON CONFLICT DO NOTHING)
SELECT u.id, u.epoch, u.output_seq, true AS written FROM u
UNION ALL
SELECT o.id, o.epoch, o.output_seq, false FROM observers o WHERE {_MY_BATCH}
"""

# $1 ids, $2 me, $3 {"<id>:<epoch>": true}, $4 detail: the copy has stopped; the row is
# released, or becomes what its holder's stop makes of it (deleted), whichever way it was asked
# to stop. A move the leader recorded (handoff_to) is where the observer is directed next: the
# target takes it from the database if the handoff's directed start does not reach it.
RELEASE = skipping_locked(
    lambda _: _MY_BATCH,
    f"status = {sql_stopped('o.status')}, service_id = NULL, directed_to = o.handoff_to, "
    "handoff_to = NULL, modified_at = now()",
    "o.status",
    events=(_release_event("u.status"), "$4::text"),
)


def copy_key(observer_id: object, epoch: int) -> str:
    """How $3 of COMMIT and RELEASE names one copy."""
    return f"{observer_id}:{epoch}"


# $1 ids, $2 me, $3 {"<id>:<epoch>": true or false}: whether each copy holds a live work-queue
# delivery (the sweeper leaves a gone service's queued observers to the broker's requeue). A
# copy loses its delivery with its broker session (requeued, or gone with a deleted queue) and
# gets one back when a redelivery is adopted. Bookkeeping only: a locked row is skipped.
# Returns the copies' rows it skipped, locked meanwhile: their marks are written again.
MARK_QUEUED = f"""
WITH free AS (SELECT o.id FROM observers o WHERE {_MY_BATCH}
                 FOR NO KEY UPDATE OF o SKIP LOCKED),
     done AS (UPDATE observers o
                 SET queued_epoch = CASE WHEN ($3::jsonb -> {_COPY})::boolean THEN o.epoch END
               WHERE {_MY_BATCH} AND o.id = ANY(ARRAY(SELECT free.id FROM free))
           RETURNING o.id)
SELECT o.id FROM observers o WHERE {_MY_BATCH} AND o.id <> ALL(ARRAY(SELECT id FROM done))
"""

# $1 id, $2 me, $3 epoch, $4 error, $5 reset_after (s), $6 max_restarts. Restarts are counted
# in a window that heals: after reset_after seconds without one, the count starts again. A row
# locked by another transaction fails it at once (NOWAIT: RowLocked, retried), never a wait.
RECORD_ERROR = with_events(
    f"""
WITH cur AS (
    SELECT id, CASE WHEN restarted_at IS NULL
                      OR restarted_at < clock_timestamp() - make_interval(secs => $5)
                    THEN 1 ELSE restart_count + 1 END AS n,
           status = {_PROCESSING} AS may_fail
      FROM observers
     WHERE id = $1 AND epoch = $3 AND service_id = $2 AND {sql_in("status", HELD)}
       FOR NO KEY UPDATE NOWAIT)
UPDATE observers o
   SET restart_count = CASE WHEN cur.may_fail AND cur.n > $6 THEN cur.n - 1 ELSE cur.n END,
       status = CASE WHEN cur.may_fail AND cur.n > $6 THEN {_FAILED} ELSE o.status END,
       service_id = CASE WHEN cur.may_fail AND cur.n > $6 THEN NULL ELSE o.service_id END,
       restarted_at = clock_timestamp(), last_error = $4, modified_at = now()
  FROM cur WHERE o.id = cur.id
RETURNING o.id, o.epoch, o.restart_count, o.status""",
    f"CASE u.status WHEN {_FAILED} THEN {event(Event.FAILED)} ELSE {event(Event.RESTARTED)} END",
    error_line("$4"),
)

# $1 id, $2 me, $3 epoch, $4 error: a copy that cannot run here at all (kind not installed).
FAIL = with_events(
    f"UPDATE observers SET status = {_FAILED}, service_id = NULL, last_error = $4, "
    f"modified_at = now() WHERE id = $1 AND epoch = $3 AND service_id = $2 "
    f"AND status = {_PROCESSING} RETURNING id, epoch",
    event(Event.FAILED),
    error_line("$4"),
)

# $1 id, $2 me, $3 reason: a copy blocked the event loop for longer than the lease, which cost
# this service its lease: the observer is failed with no lease needed (whoever holds it now runs
# the same blocking code). Only a failure, never a take: it cannot make two copies run.
# $1 me: one step of kind code blocks the loop (the watchdog thread): see services.stalled_since.
MARK_STALLED = (
    "UPDATE services SET stalled_since = clock_timestamp() WHERE id = $1 AND stalled_since IS NULL"
)

BLAME = with_events(
    f"UPDATE observers SET status = {_FAILED}, service_id = NULL, last_error = $3, "
    f"modified_at = now() WHERE id = $1 AND $2::uuid IS NOT NULL "
    f"AND status IN ({_PROCESSING}, '{ObserverStatus.CREATED.value}') RETURNING id, epoch",
    event(Event.FAILED),
    error_line("$3"),
)

# $1 observers this service runs, $2 me: release what the database says we hold but we do
# not run (after a fence, or when the periodic check finds a difference).
RECONCILE = with_events(
    f"UPDATE observers o SET status = {sql_stopped('o.status')}, service_id = NULL, "
    f"modified_at = now() WHERE o.service_id = $2 AND ({sql_in('o.status', HELD)}) IS TRUE "
    "AND NOT (o.id = ANY($1::uuid[])) RETURNING o.id, o.epoch, o.status",
    _release_event("u.status"),
    "'not running here'",
)

# $1 me: the copies the database says this service holds (read after a renewal on a new lease
# session, to find what was taken while the old one was down).
# Both by the holder's index alone (``IS TRUE`` hides the status from the planner): the status
# index would add a bitmap of every running observer of the fleet to each read.
HELD_COPIES = (
    f"SELECT id, epoch FROM observers WHERE service_id = $1 AND ({sql_in('status', HELD)}) IS TRUE"
)

# How many of them there are, from the counts the triggers keep: the check every
# ORCH_CHECK_EVERY reads this service's few count rows, not the rows it holds.
HELD_COUNT = f"SELECT {held_by('$1')}"

# --------------------------------------------------------------------------------- control
# $1 observer ids, $2 me: what a control message is checked against before it is acted on
# (``observer_service.control``): this service's draining flag and each named observer's row,
# all by primary key. One row at least (the flag), one per observer found.
CONTROL_FACTS = """
SELECT (SELECT draining FROM services WHERE id = $2) AS draining,
       o.id, o.status, o.service_id, o.epoch, o.handoff_to
  FROM (SELECT 1) AS one LEFT JOIN observers o ON o.id = ANY($1::uuid[])
"""

# ------------------------------------------------------------------------------------ lease
# $1 me, $2 name, $3 worker_count, $4 host, $5 pid, $6 version, $7 the kinds it runs (JSON
# text), $8 its pool, $9 lock key, $10 ttl: register, or come back after a fence (with the new
# session's lock key; ``rejoined_at`` keeps the leader's directed starts and moves away for a
# while: see manager FREE_SLOTS). A death proven earlier is over: ``gone_at`` kept made the
# sweeper, at the next death by lease alone, wait for a requeue the broker never made.
JOIN = """
INSERT INTO services AS s (id, name, worker_count, host, pid, version, kinds, pool, lock_key,
                           lease_expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7::text::jsonb, $8, $9,
        clock_timestamp() + make_interval(secs => $10))
ON CONFLICT (id) DO UPDATE
   SET lock_key = EXCLUDED.lock_key, lease_expires_at = EXCLUDED.lease_expires_at,
       is_deleted = false, last_heartbeat_at = clock_timestamp(), modified_at = now(),
       stalled_since = NULL, rejoined_at = clock_timestamp(), gone_at = NULL
RETURNING s.draining
"""

# $1 me, $2 ttl, $3 the renewing session's lock key, $4 kind code blocked the loop lately (the
# stall mark stays: a service whose kinds block its loop is never taken over fast), $5 seconds
# after which an observer directed to me (``directed_to``) that nobody took is read here: its
# directed start was lost with a control queue, or not published in a broker alarm. Only an
# unexpired lease is renewed: one found expired (a suspend, a pause longer than the lease) may
# have had its observers taken, so the service fences and rejoins instead. The observers being
# stopped and those directed come as JSON text: a uuid[] would cost a new session two more
# round trips (asyncpg introspects the array type), and a session is renewed on a slow link
# too.
RENEW = f"""
UPDATE services
   SET lease_expires_at = clock_timestamp() + make_interval(secs => $2), lock_key = $3,
       last_heartbeat_at = clock_timestamp(), modified_at = now(),
       stalled_since = CASE WHEN $4 THEN coalesce(stalled_since, clock_timestamp()) END,
       taking = CASE WHEN $6::text <> '' THEN string_to_array($6::text, ',')::uuid[] END,
       rss_bytes = $7, cpu = $8
 WHERE id = $1 AND NOT is_deleted AND lease_expires_at > clock_timestamp()
RETURNING (SELECT coalesce(json_agg(id), '[]')::text FROM observers
            WHERE service_id = $1 AND {sql_in("status", STOPPING)}),
          draining,
          (SELECT coalesce(json_agg(json_build_array(o.id, o.dispatch_id)), '[]')::text
             FROM observers o
            WHERE o.directed_to = $1 AND o.service_id IS NULL AND {sql_in("o.status", LIVE)}
              AND o.modified_at < clock_timestamp() - make_interval(secs => $5)),
          extract(epoch FROM clock_timestamp())::float8,
          {TIMELINE}
"""

LEAVE = """
UPDATE services SET is_deleted = true, lease_expires_at = clock_timestamp(), modified_at = now()
 WHERE id = $1
"""


# ------------------------------------------------------------------------------------ outputs
# $1 observer ids: what earlier copies of these observers committed and nobody confirmed yet
# (on a service that died or froze, or here), to publish before a new copy's own.
BACKLOG = """
SELECT observer_id, seq, epoch, kind, name, records::text AS records,
       extract(epoch FROM committed_at)::float8 AS committed_at
  FROM observer_outputs WHERE observer_id = ANY($1::uuid[])
 ORDER BY observer_id, seq
"""

# $1 observer ids, $2 first seqs: the commits whose every record the broker confirmed.
DELETE_PUBLISHED = """
DELETE FROM observer_outputs x USING unnest($1::uuid[], $2::bigint[]) AS p(observer_id, seq)
 WHERE x.observer_id = p.observer_id AND x.seq = p.seq
"""
