"""Every SQL statement the manager runs, in one place. Conditions on statuses and service
liveness are built from ``orch_contracts.statuses``, never spelled out as literals here."""

from __future__ import annotations

from orch_contracts.statuses import (
    HELD,
    LIVE,
    Event,
    ObserverStatus,
    held_by,
    live_service,
    sql_in,
    sql_stopped,
)

S = ObserverStatus


def _v(status: ObserverStatus | Event) -> str:
    return f"'{status.value}'"


# ---------------------------------------------------------------------- who can run what
def advertised(s: str) -> str:
    """SQL: what service row ``s`` advertised of its kinds as an object, ``{}`` (no kind) for an
    advert that is not one: a services row is another process's input, never a reason for a
    statement of the manager's to fail (``orch_contracts.adverts``)."""
    return f"CASE WHEN jsonb_typeof({s}.kinds) = 'object' THEN {s}.kinds ELSE '{{}}'::jsonb END"


def versions_of(s: str) -> str:
    """SQL: the kinds service row ``s`` runs, each with its version, as a flat object (NULL: a
    service of a release before adverts, which runs every kind); never the adverts themselves,
    which may be nested as deep as their writer liked."""
    return (
        f"CASE WHEN {s}.kinds IS NOT NULL THEN COALESCE((SELECT jsonb_object_agg(k.key, "
        f"COALESCE(left(k.value ->> 'version', 64), '1')) FROM jsonb_each({advertised(s)}) k), "
        "'{}'::jsonb) END"
    )


def runs(r: str, o: str) -> str:
    """SQL: service ``r`` runs observer ``o``: its pool, its kind, and the version it is pinned
    to, if any (a service of a release before kinds were advertised runs every kind, but no
    pinned observer: it cannot tell versions)."""
    return (
        f"{r}.pool = {o}.pool AND CASE WHEN {r}.kinds IS NULL THEN {o}.kind_version IS NULL "
        f"ELSE jsonb_typeof({r}.kinds) = 'object' AND {r}.kinds ? {o}.kind AND "
        f"({o}.kind_version IS NULL "
        f"OR {r}.kinds -> {o}.kind ->> 'version' = {o}.kind_version) END"
    )


def runnable(o: str) -> str:
    """SQL: some live service that takes work runs observer ``o``. A few rows of ``services``,
    by the index of live leases."""
    return (
        f"EXISTS (SELECT 1 FROM services r WHERE {live_service('r')} AND NOT r.draining "
        f"AND {runs('r', o)})"
    )


def why_waiting(o: str) -> str:
    """SQL: why nobody runs observer ``o``, which waits: a service of its pool runs its kind
    (in its version) but has no room, or none does (or its pool has no live service taking
    work at all)."""
    in_pool = f"CASE WHEN {o}.pool = 'default' THEN '' ELSE format(' in pool %L', {o}.pool) END"
    what = (
        f"format('kind %L', {o}.kind) || CASE WHEN {o}.kind_version IS NULL THEN '' "
        f"ELSE format(' version %L', {o}.kind_version) END"
    )
    pool_live = (
        f"EXISTS (SELECT 1 FROM services r WHERE {live_service('r')} AND NOT r.draining "
        f"AND r.pool = {o}.pool)"
    )
    return f"""CASE WHEN {runnable(o)}
        THEN format('no service%s that runs %s has a free slot now', {in_pool}, {what})
        WHEN {o}.pool <> 'default' AND NOT {pool_live}
        THEN format('no live service in pool %L', {o}.pool)
        ELSE format('no live service%s runs %s', {in_pool}, {what}) END"""


#: Why a live observer that some live service could run has no slot: it waits in its pool's
#: work queue, or its service stopped renewing its lease and it is sent to another.
WAIT_QUEUED = "queued for a free slot"
WAIT_MOVING = "its service is gone: it moves to a live one"


def waiting_shown(o: str) -> str:
    """SQL: why ``o``, live, has no slot, as shown: what its row says (a service passed it
    on); for one nobody holds, that it is queued for a free slot, or why no live service can
    run it (none of its pool, or none of its pool runs its kind in its version); for one whose
    service lost its lease, that it moves. NULL while a live service holds it. Read when shown,
    so it is never out of date."""
    held = f"EXISTS (SELECT 1 FROM services h WHERE h.id = {o}.service_id AND {live_service('h')})"
    return f"""COALESCE({o}.waiting, CASE
        WHEN NOT {sql_in(o + ".status", LIVE)} OR {held} THEN NULL
        WHEN NOT {runnable(o)} THEN {why_waiting(o)}
        WHEN {o}.service_id IS NULL THEN '{WAIT_QUEUED}'
        ELSE '{WAIT_MOVING}' END)"""


OBSERVER_COLUMNS = (
    "o.id, o.name, o.kind, o.params, o.status, o.service_id, o.epoch, o.checkpoint, "
    "o.checkpointed_at, o.restart_count, o.last_error, o.restart_policy, o.created_at, "
    "o.modified_at, o.started_at, o.output_seq, o.committed_at, o.pool, o.kind_version, "
    f"{waiting_shown('o')} AS waiting"
)

SERVICE_COLUMNS = (
    "s.id, s.name, s.worker_count, s.host, s.pid, s.version, s.created_at, "
    "s.last_heartbeat_at, s.lease_expires_at, s.is_deleted, s.draining, s.pool, "
    "s.rss_bytes, s.cpu, "
    "CASE WHEN s.kinds IS NOT NULL THEN ARRAY(SELECT jsonb_object_keys("
    f"{advertised('s')}) ORDER BY 1) END AS kinds, "
    f"{held_by('s.id')} AS running"
)

# ---------------------------------------------------------------------------------- history
# :ids, :event, :detail, :actor (one event for many observers; the token that asked, or NULL)
EVENTS = (
    "INSERT INTO observer_events (observer_id, event, detail, actor) "
    "SELECT i, :event, :detail, :actor FROM unnest(CAST(:ids AS uuid[])) AS i"
)
# :ids, :event, :details, :actor (one event, a detail each)
EVENTS_EACH = (
    "INSERT INTO observer_events (observer_id, event, detail, actor) "
    "SELECT i, :event, d, :actor "
    "FROM unnest(CAST(:ids AS uuid[]), CAST(:details AS text[])) AS x(i, d)"
)
# :ids, :event, :detail, :services (one event, the service each was sent to; NULL: none)
EVENTS_TO = (
    "INSERT INTO observer_events (observer_id, event, detail, service_id) "
    "SELECT i, :event, :detail, s FROM unnest(CAST(:ids AS uuid[]), CAST(:services AS uuid[])) "
    "AS x(i, s)"
)
# The newest actions asked through the API: by one token (:by), or by any (:by NULL); :n at most.
# Two plans, each by the partial index on (actor, id): one token's newest, or every token's.
ACTIONS_BY = (
    "SELECT e.at, e.event, e.actor, e.detail, e.observer_id, o.name AS observer_name, o.kind "
    "FROM observer_events e JOIN observers o ON o.id = e.observer_id "
    "WHERE e.actor = :by ORDER BY e.id DESC LIMIT :n"
)
ACTIONS = (
    "SELECT e.at, e.event, e.actor, e.detail, e.observer_id, o.name AS observer_name, o.kind "
    "FROM observer_events e JOIN observers o ON o.id = e.observer_id "
    "WHERE e.actor IS NOT NULL ORDER BY e.id DESC LIMIT :n"
)
# The service's name too, for services long gone (their rows stay, deleted).
# A take's detail names the holder it took from by id ("from <uuid>"): shown by its name.
LIST_EVENTS = (
    "SELECT e.at, e.event, e.service_id, s.name AS service_name, e.epoch, e.actor, "
    "CASE WHEN e.detail ~ '^from [0-9a-f-]{36}$' THEN 'from ' || coalesce("
    "(SELECT f.name || ' (' || left(f.id::text, 8) || ')' FROM services f "
    "WHERE f.id = CAST(substr(e.detail, 6) AS uuid)), substr(e.detail, 6)) "
    "ELSE e.detail END AS detail "
    "FROM observer_events e LEFT JOIN services s ON s.id = e.service_id "
    "WHERE e.observer_id = :id ORDER BY e.id"
)

# ----------------------------------------------------------------------------------- outbox
# :routes, :services, :pools, :bodies
OUTBOX_ADD = (
    "INSERT INTO outbox (route, service_id, pool, body, trace) "
    "SELECT r, s, p, CAST(b AS jsonb), CAST(t AS jsonb) "
    "FROM unnest(CAST(:routes AS text[]), CAST(:services AS uuid[]), CAST(:pools AS text[]), "
    "CAST(:bodies AS text[]), CAST(:traces AS text[])) WITH ORDINALITY AS m(r, s, p, b, t, n) "
    "ORDER BY n RETURNING id"
)
OUTBOX_DELETE = "DELETE FROM outbox WHERE id = ANY(:ids)"
OUTBOX_DUE = (
    "SELECT id, route, service_id, pool, body, trace FROM outbox "
    "WHERE created_at < now() - make_interval(secs => :g) AND NOT (id = ANY(:skip)) "
    "ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED"
)

# -------------------------------------------------------------------------------- observers
# One statement: the row, its history and its outbox record (one round trip).
# Many in one statement: a name already taken by a live observer, or one that looks like it
# (the same name_key), skips its row (no error), so one conflict fails only its own item.
CREATE_MANY = f"""
WITH v AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:names AS text[]), CAST(:keys AS text[]),
                         CAST(:kinds AS text[]), CAST(:params AS text[]), CAST(:ds AS uuid[]),
                         CAST(:rps AS text[]), CAST(:bodies AS text[]), CAST(:pools AS text[]),
                         CAST(:versions AS text[]), CAST(:traces AS text[]),
                         CAST(:actors AS text[]))
           WITH ORDINALITY AS v(id, name, name_key, kind, params, d, rp, body, pool, version,
                                trace, actor, n)
), o AS (
    INSERT INTO observers AS o (id, name, name_key, kind, params, status, dispatch_id,
                                restart_policy, pool, kind_version)
    SELECT v.id, v.name, v.name_key, v.kind, CAST(v.params AS jsonb), {_v(S.CREATED)}, v.d,
           CAST(v.rp AS jsonb), v.pool, v.version
      FROM v ORDER BY v.n
    ON CONFLICT DO NOTHING
    RETURNING {OBSERVER_COLUMNS}
), e AS (
    INSERT INTO observer_events (observer_id, event, actor)
    SELECT o.id, {_v(Event.CREATED)}, v.actor FROM o JOIN v ON v.id = o.id
), b AS (
    INSERT INTO outbox (route, pool, body, trace)
    SELECT :route, v.pool, CAST(v.body AS jsonb), CAST(v.trace AS jsonb)
      FROM v JOIN o ON o.id = v.id ORDER BY v.n
    RETURNING id, CAST(body ->> 'observer_id' AS uuid) AS observer_id
)
SELECT o.*, b.id AS outbox_id FROM o JOIN b ON b.observer_id = o.id
"""
# The live observers that hold these name keys (to name them in a refusal).
NAME_HOLDERS = (
    "SELECT id, name, name_key FROM observers "
    f"WHERE name_key = ANY(CAST(:keys AS text[])) AND status <> {_v(S.DELETED)}"
)
GET = f"SELECT {OBSERVER_COLUMNS} FROM observers o WHERE o.id = :id"
LIST = (
    f"SELECT {OBSERVER_COLUMNS} FROM observers o "
    "WHERE (CAST(:status AS text) IS NULL OR o.status = :status) "
    "AND (CAST(:kind AS text) IS NULL OR o.kind = :kind) "
    "AND (CAST(:pool AS text) IS NULL OR o.pool = :pool) "
    "AND (CAST(:params AS jsonb) IS NULL OR o.params @> CAST(:params AS jsonb)) "
    "AND (CAST(:sid AS uuid) IS NULL OR o.service_id = :sid) "
    r"AND (CAST(:name AS text) IS NULL OR o.name ILIKE '%' || :name || '%' ESCAPE '\') "
    f"AND (CAST(:with_deleted AS boolean) OR o.status <> {_v(S.DELETED)}) "
    "ORDER BY o.created_at, o.id LIMIT :limit OFFSET :offset"
)
# The observers an action takes (``POST /observers/actions``): not deleted, every condition
# given; one more than :limit, to tell that more match.
SELECT_FOR_ACTION = (
    f"SELECT o.id FROM observers o WHERE o.status <> {_v(S.DELETED)} "
    "AND (CAST(:ids AS uuid[]) IS NULL OR o.id = ANY(CAST(:ids AS uuid[]))) "
    "AND (CAST(:status AS text) IS NULL OR o.status = :status) "
    "AND (CAST(:kind AS text) IS NULL OR o.kind = :kind) "
    "AND (CAST(:pool AS text) IS NULL OR o.pool = :pool) "
    r"AND (CAST(:prefix AS text) IS NULL OR o.name LIKE :prefix || '%' ESCAPE '\') "
    "ORDER BY o.created_at, o.id LIMIT :limit + 1"
)
# A move: these observers (not deleted, and not already where they are asked to go) to the pool
# :pool (NULL: their own) and pinned to :version (:unpin: to none; else NULL: as they are);
# ``moved_at`` marks those the leader's mover must look at (``manager/moves.py``).
MOVE = f"""
WITH m AS (
    SELECT o.id, COALESCE(CAST(:pool AS text), o.pool) AS pool,
           CASE WHEN :unpin THEN NULL ELSE COALESCE(CAST(:version AS text), o.kind_version) END
           AS version
      FROM observers o
     WHERE o.id = ANY(:ids) AND o.status <> {_v(S.DELETED)}
     FOR UPDATE OF o
)
UPDATE observers o SET pool = m.pool, kind_version = m.version, moved_at = now(),
       modified_at = now()
  FROM m WHERE o.id = m.id AND (o.pool, o.kind_version) IS DISTINCT FROM (m.pool, m.version)
RETURNING o.id, o.status, o.service_id, o.pool, o.kind, o.kind_version
"""
# The kinds (and pinned versions) a move would put in each pool: what must be offered there.
MOVE_TARGETS = """
SELECT DISTINCT COALESCE(CAST(:pool AS text), o.pool) AS pool, o.kind,
       CASE WHEN :unpin THEN NULL ELSE COALESCE(CAST(:version AS text), o.kind_version) END
       AS version
  FROM observers o WHERE o.id = ANY(:ids)
"""
# Observers asked to move, oldest ask first, with their holder's pool and kinds: the mover
# hands over those their holder cannot run any more, and forgets the others.
MOVING = f"""
SELECT o.id, o.status, o.service_id, o.pool, o.kind, o.kind_version,
       s.pool AS holder_pool, {versions_of("s")} AS holder_kinds,
       COALESCE({live_service("s")}, false) AS holder_live
  FROM observers o LEFT JOIN services s ON s.id = o.service_id
 WHERE o.moved_at IS NOT NULL ORDER BY o.moved_at LIMIT :n
"""
# The first asked to move, if any: by the partial index of moving observers (ORDER BY
# and LIMIT 1 hold the planner to it; MOVING alone, planned on statistics from a bulk intake,
# scanned every observer twice a second on an idle fleet).
FIRST_MOVING = (
    "SELECT o.id FROM observers o WHERE o.moved_at IS NOT NULL ORDER BY o.moved_at LIMIT 1"
)
MOVED = "UPDATE observers SET moved_at = NULL WHERE id = ANY(:ids) AND moved_at IS NOT NULL"
# An observer's row, locked; then, in a statement of its own, whether its holder lives. Joined in
# one statement, a lock that waited for a take re-checked the taken row against the holder it had
# read before the wait: the join failed, the holder looked gone, and a delete or pause answered
# at once while the new copy ran on.
LOCK = "SELECT o.status, o.service_id, o.pool FROM observers o WHERE o.id = :id FOR UPDATE"
HOLDER_LIVE = (
    f"SELECT COALESCE((SELECT {live_service('s')} FROM services s WHERE s.id = :sid), false)"
)
SET_STATUS = "UPDATE observers SET status = :status, modified_at = now() WHERE id = :id"
# An observer about to have its params edited, locked until the edit commits (a pause, resume,
# move or another edit meanwhile waits for it, and sees it).
GET_LOCKED = f"SELECT {OBSERVER_COLUMNS} FROM observers o WHERE o.id = :id FOR UPDATE"
EDIT_PARAMS = (
    "UPDATE observers SET params = CAST(:params AS jsonb), modified_at = now() WHERE id = :id"
)
# Being stopped by a holder that is gone: complete the stop (deleted, paused).
COMPLETE_STOPS = (
    f"UPDATE observers SET status = {sql_stopped('status')}, service_id = NULL, waiting = NULL, "
    "modified_at = now() WHERE id = ANY(:ids) RETURNING id, status"
)
# :status is deleted or paused: nothing runs the observer, so the stop is done at once.
STOP_NOW = (
    "UPDATE observers SET status = :status, service_id = NULL, waiting = NULL, modified_at = now() "
    "WHERE id = :id"
)
RESUME = (
    f"UPDATE observers SET status = {_v(S.CREATED)}, service_id = NULL, dispatch_id = :d, "
    "waiting = NULL, directed_to = NULL, dispatched_at = now(), modified_at = now() "
    "WHERE id = :id"
)
RESTART = (
    f"UPDATE observers SET status = {_v(S.CREATED)}, service_id = NULL, restart_count = 0, "
    "restarted_at = NULL, dispatch_id = :d, "
    "waiting = NULL, directed_to = NULL, dispatched_at = now(), modified_at = now() "
    "WHERE id = :id"
)

# --------------------------------------------------------------------------------- services
LIST_SERVICES = (
    f"SELECT {SERVICE_COLUMNS} FROM services s WHERE :all OR NOT s.is_deleted ORDER BY s.created_at"
)
GET_SERVICE = f"SELECT {SERVICE_COLUMNS} FROM services s WHERE s.id = :id"
LIVE_SERVICES_NAMED = f"SELECT s.id FROM services s WHERE s.name = :name AND {live_service('s')}"
DRAIN = (
    "UPDATE services SET draining = true, modified_at = now() "
    "WHERE id = :id AND NOT is_deleted RETURNING id"
)
UNDRAIN = (
    "UPDATE services SET draining = false, modified_at = now() "
    "WHERE id = :id AND NOT is_deleted RETURNING id"
)

# ---------------------------------------------------------------------- leader: the sweeper
# A services row another transaction has locked (a take's FOR SHARE) is skipped, never waited
# for: the next sweep sees it again.
SWEEP_EXPIRED = (
    "UPDATE services SET is_deleted = true, modified_at = now() "
    "WHERE id = ANY(ARRAY(SELECT id FROM services WHERE NOT is_deleted "
    "AND lease_expires_at < clock_timestamp() FOR NO KEY UPDATE SKIP LOCKED)) RETURNING id, name"
)
# Live by their lease, but their lease session has ended: the process may be gone (it is when
# its broker connection is gone too) or it is fencing itself.
# One whose loop a kind blocks (``stalled_since``) cannot notice it and pause: it is waited for.
SESSION_ENDED = (
    f"SELECT s.id FROM services s WHERE {live_service('s')} AND s.stalled_since IS NULL "
    "AND pg_try_advisory_xact_lock(s.lock_key)"
)
# Only while the row still names a lease session that has ended: a service that came back on a
# new session (a new lock key, held) between the looks and this statement lives, and may already
# run observers again. (The lock this transaction took when it looked is its own to take again.)
DECLARE_GONE = (
    "UPDATE services SET is_deleted = true, lease_expires_at = clock_timestamp(), "
    "gone_at = clock_timestamp(), "
    "modified_at = now() WHERE id = ANY(ARRAY(SELECT id FROM services WHERE id = ANY(:ids) "
    "AND NOT is_deleted AND stalled_since IS NULL AND pg_try_advisory_xact_lock(lock_key) "
    "FOR NO KEY UPDATE SKIP LOCKED)) RETURNING id, name"
)
# Dead services (the orphans' holders); then what they hold, by the service_id index. A sweep
# reads what dead services still hold, not every observer.
DEAD_SERVICES = f"SELECT s.id FROM services s WHERE NOT {live_service('s')}"


def _gone_within(secs: str) -> str:
    """The services among :dead proven gone less than ``secs`` seconds ago."""
    return (
        "SELECT s.id FROM services s WHERE s.id = ANY(CAST(:dead AS uuid[])) "
        f"AND s.gone_at > clock_timestamp() - make_interval(secs => {secs})"
    )


# Not those that came by the work queue to a service proven gone less than :grace seconds
# ago, or less than :patience seconds ago while its observers are still being taken
# (:progressing): the broker requeued their deliveries, and the services are working through
# them.
ORPHANS = f"""
SELECT o.id, o.status FROM observers o
 WHERE o.service_id = ANY(CAST(:dead AS uuid[])) AND {sql_in("o.status", HELD)}
   AND (o.queued_epoch = o.epoch AND o.status = {_v(S.PROCESSING)}
        AND (o.service_id = ANY(ARRAY({_gone_within(":grace")}))
             OR (o.service_id = ANY(CAST(:progressing AS uuid[]))
                 AND o.service_id = ANY(ARRAY({_gone_within(":patience")}))))) IS NOT TRUE
   FOR UPDATE OF o SKIP LOCKED
"""
# How many live observers each of :dead still holds, where it holds any (from the counts).
HELD_BY_DEAD = f"""
SELECT c.service_id, CAST(sum(c.n) AS bigint) AS n FROM observer_counts c
 WHERE c.service_id = ANY(CAST(:dead AS uuid[])) AND {sql_in("c.status", HELD)}
 GROUP BY c.service_id HAVING sum(c.n) > 0
"""
# Whether a dead service still holds a live observer: the sweeper's look before anything
# costly, four times a second, from the counts the triggers keep. On the observers, the generic
# plan of this EXISTS was a sequential scan of every row (it expects an early match): once any
# dead service's row was kept, 420,000 rows read a second at 100,000 observers.
ANY_ORPHAN = f"""
SELECT EXISTS (SELECT 1 FROM observer_counts c
                WHERE c.service_id = ANY(CAST(:dead AS uuid[])) AND {sql_in("c.status", HELD)}
                GROUP BY c.service_id HAVING sum(c.n) > 0)
"""
# New dispatch ids (old start messages become stale), nobody holding them.
# :targets, one per id: the service each start is directed to (NULL: its pool's work queue).
REDISPATCH = """
UPDATE observers o SET dispatch_id = gen_random_uuid(), service_id = NULL, waiting = NULL,
       directed_to = t.target, dispatched_at = now(), modified_at = now()
  FROM unnest(CAST(:ids AS uuid[]), CAST(:targets AS uuid[])) AS t(id, target)
 WHERE o.id = t.id
RETURNING o.id, o.dispatch_id
"""
# The pool, kind and pinned version of each of these observers.
NEEDS_OF = "SELECT id, pool, kind, kind_version FROM observers WHERE id = ANY(:ids)"
# The pool of each of these services, and the kinds it runs with their versions (the adverts):
# NULL for a service of an earlier release (every kind).
KINDS_RUN = (
    f"SELECT s.id, s.pool, {versions_of('s')} AS kinds FROM services s WHERE s.id = ANY(:ids)"
)
# What each live service advertised of its kinds (NULL: an earlier release, every kind), each
# advert as text: read as untrusted input (``orch_contracts.adverts``).
LIVE_ADVERTS = f"""
SELECT s.name, s.pool, s.kinds IS NULL AS every, k.key AS kind, k.value::text AS advert
  FROM services s LEFT JOIN LATERAL jsonb_each({advertised("s")}) AS k ON true
 WHERE {live_service("s")} ORDER BY s.name, k.key
"""
# Every kind and version each pool's services ever advertised (while their rows are kept): the
# advert of the newest service of the pool that runs it, a live one first, as text.
ADVERTS = f"""
SELECT DISTINCT ON (s.pool, k.key, k.value ->> 'version') s.pool, k.key AS name, s.name AS
       service, k.value::text AS advert, {live_service("s")} AS live, s.created_at
  FROM services s, jsonb_each({advertised("s")}) AS k
 ORDER BY s.pool, k.key, k.value ->> 'version', {live_service("s")} DESC, s.created_at DESC
"""
# The kinds each service runs (while its row is kept), with their versions: whose advert tells
# a held observer's secrets.
HOLDER_KINDS = f"SELECT s.id, {versions_of('s')} AS kinds FROM services s"
# Every pool some service joined (while its row is kept), and whether one of its services runs
# every kind (an earlier release).
POOLS = "SELECT pool, bool_or(kinds IS NULL) AS every FROM services GROUP BY pool ORDER BY pool"
# Live observers nobody holds that wait for a service able to run them, oldest first: those of
# what a service with room runs (:pools, :kinds, :versions, one each for every kind it runs; a
# NULL kind: every kind, but no pinned version). The partial index of unheld observers finds
# them.
_WAITING = f"o.waiting IS NOT NULL AND o.service_id IS NULL AND {sql_in('o.status', LIVE)}"
ANY_WAITING = f"SELECT EXISTS (SELECT 1 FROM observers o WHERE {_WAITING})"
WAITING = f"""
SELECT o.id FROM observers o
 WHERE {_WAITING} AND EXISTS (
       SELECT 1 FROM unnest(CAST(:pools AS text[]), CAST(:kinds AS text[]),
                            CAST(:versions AS text[])) AS r(pool, kind, version)
        WHERE r.pool = o.pool AND CASE WHEN r.kind IS NULL THEN o.kind_version IS NULL
              ELSE r.kind = o.kind AND (o.kind_version IS NULL OR o.kind_version = r.version)
              END)
 ORDER BY o.created_at LIMIT 1000 FOR UPDATE OF o SKIP LOCKED
"""
# Why the others wait, where that is not said yet.
UNEXPLAINED = f"""
SELECT o.id, w.why FROM observers o CROSS JOIN LATERAL (SELECT {why_waiting("o")} AS why) AS w
 WHERE {_WAITING} AND o.waiting IS DISTINCT FROM w.why
 ORDER BY o.created_at LIMIT 1000 FOR UPDATE OF o SKIP LOCKED
"""
# Why each still waits.
SET_WAITING = (
    "UPDATE observers o SET waiting = m.why FROM unnest(CAST(:ids AS uuid[]), "
    "CAST(:whys AS text[])) AS m(id, why) WHERE o.id = m.id AND o.waiting IS DISTINCT FROM m.why"
)
# Free slots of every service that surely lives (lease valid for :m more seconds), takes work,
# and keeps its lease: not stalled by kind code, and not back from a lost lease within :p seconds
# (one that cannot keep a lease would take the observer only to lose it again).
FREE_SLOTS = f"""
SELECT s.id, s.worker_count - {held_by("s.id")} AS free
  FROM services s
 WHERE NOT s.is_deleted AND NOT s.draining AND s.stalled_since IS NULL
   AND s.lease_expires_at > clock_timestamp() + make_interval(secs => :m)
   AND (s.rejoined_at IS NOT NULL
        AND s.rejoined_at >= clock_timestamp() - make_interval(secs => :p)) = :probation
"""


def _last_take(pool: str) -> str:
    """When something of ``pool`` was last taken within :g seconds (NULL: nothing), by the
    started_at index, newest first."""
    return (
        "(SELECT o.started_at FROM observers o "
        "WHERE o.started_at > now() - make_interval(secs => :g) "
        f"AND o.pool = {pool} ORDER BY o.started_at DESC LIMIT 1)"
    )


# ------------------------------------------------------------------------ leader: the audit
# The pools of live services, and the default pool, where nothing was taken in the last :g
# seconds: per pool, its newest take of those seconds by the index on started_at. (A scalar
# subquery with ORDER BY and LIMIT 1 holds the planner to that index; as an anti-join it
# chose to scan every observer, four times a second, on an idle fleet.)
IDLE_POOLS = f"""
SELECT p.pool FROM (SELECT s.pool FROM services s WHERE {live_service("s")}
                    UNION SELECT 'default') AS p(pool)
 WHERE {_last_take("p.pool")} IS NULL
"""
# Of the pools :pools. A start still in the outbox is on its way, unless it has been there
# longer than :g (the broker blocks publishers: an alarm); then it is stuck too. One a live
# service was taking at its last renewal is not stuck: its take is slow (a slow database link),
# and a start sent anew would only cost that link a round trip to drop it as stale. One directed
# to a live service (a handoff's target, a re-dispatch's choice) in the last :directed seconds is
# that service's to take: its renewal reads it from the database if the directed message was
# lost, and a start sent anew would make the one on its way stale (a move caught by a host-wide
# stall of 0.4 s was taken 1.04 s after its release, where others took a median 19 ms).
UNHELD_STUCK = f"""
SELECT o.id, o.pool FROM observers o WHERE {sql_in("o.status", LIVE)} AND o.service_id IS NULL
   AND o.pool = ANY(:pools)
   AND o.waiting IS NULL AND o.dispatched_at < now() - make_interval(secs => :g)
   AND o.modified_at < now() - make_interval(secs => :g)
   AND NOT (o.directed_to IS NOT NULL
            AND o.modified_at > now() - make_interval(secs => :directed)
            AND EXISTS (SELECT 1 FROM services s WHERE s.id = o.directed_to
                           AND {live_service("s")} AND NOT s.draining
                           AND s.stalled_since IS NULL))
   AND NOT EXISTS (SELECT 1 FROM outbox b WHERE b.body->>'observer_id' = o.id::text
                      AND b.created_at > now() - make_interval(secs => :g))
   AND NOT EXISTS (SELECT 1 FROM services s WHERE {live_service("s")} AND o.id = ANY(s.taking))
 LIMIT 1000 FOR UPDATE OF o SKIP LOCKED
"""

# Of these observers (:ids, as text), those with a start still in the outbox, unpublished.
UNSENT = (
    "SELECT DISTINCT (body->>'observer_id')::uuid AS id FROM outbox "
    "WHERE body->>'observer_id' = ANY(CAST(:ids AS text[]))"
)

# -------------------------------------------------------------------- leader: the rebalance
# Where moved observers are: their holder, and whether they are between holders (released by the
# one asked to hand them over, not taken yet).
WHERE_MOVED = (
    f"SELECT id, service_id, status = {_v(S.PROCESSING)} AND service_id IS NULL AS in_motion "
    "FROM observers WHERE id = ANY(:ids)"
)
LOADS = f"""
SELECT s.id, s.pool, s.worker_count, {held_by("s.id")} AS running FROM services s
 WHERE {live_service("s")} AND NOT s.draining
   AND s.created_at < now() - make_interval(secs => :age) AND s.stalled_since IS NULL
   AND (s.rejoined_at IS NULL OR s.rejoined_at < now() - make_interval(secs => :age))
"""
# Of those a move's target runs: of its pool :pool and its kinds :kinds, pinned to no version
# or to the one it has (:versions, by kind); :kinds NULL: every kind, no pinned version. The
# longest running first: a move costs its observer a gap, paid by the one that went longest
# without one (not by one a crash or the previous leader just moved).
PICK_TO_MOVE = (
    f"SELECT id FROM observers o WHERE service_id = :s AND status = {_v(S.PROCESSING)} "
    "AND NOT (id = ANY(:recent)) "
    "AND coalesce(started_at, '-infinity') < now() - make_interval(secs => :settled) "
    "AND pool = :pool AND CASE WHEN CAST(:kinds AS text[]) IS NULL "
    "THEN kind_version IS NULL ELSE EXISTS (SELECT 1 FROM unnest(CAST(:kinds AS text[]), "
    "CAST(:versions AS text[])) AS r(kind, version) WHERE r.kind = o.kind "
    "AND (o.kind_version IS NULL OR o.kind_version = r.version)) END "
    "ORDER BY started_at LIMIT :n"
)
# The moves decided, recorded on the rows in the transaction that writes their handoff
# messages: only a row still running on its donor is marked (and only those are sent).
RECORD_HANDOFFS = (
    "UPDATE observers o SET handoff_to = m.target, modified_at = now() "
    "FROM unnest(CAST(:ids AS uuid[]), CAST(:froms AS uuid[]), CAST(:tos AS uuid[])) "
    "AS m(id, source, target) "
    f"WHERE o.id = m.id AND o.service_id = m.source AND o.status = {_v(S.PROCESSING)} "
    "RETURNING o.id"
)
# Moves the leader gave up on: no record of them stays on their rows.
CLEAR_HANDOFFS = (
    "UPDATE observers SET handoff_to = NULL WHERE id = ANY(:ids) AND handoff_to IS NOT NULL"
)

# --------------------------------------------------------------------------- leader election
LEADER_ACQUIRE = """
INSERT INTO leader_leases AS l (name, holder, acquired_at, expires_at)
VALUES (:name, :holder, now(), clock_timestamp() + make_interval(secs => :ttl))
ON CONFLICT (name) DO UPDATE
   SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at,
       acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE now() END
 WHERE l.expires_at <= clock_timestamp() OR l.holder = EXCLUDED.holder
RETURNING holder
"""
LEADER_RENEW = """
UPDATE leader_leases SET expires_at = clock_timestamp() + make_interval(secs => :ttl)
 WHERE name = :name AND holder = :holder AND expires_at > clock_timestamp()
RETURNING holder
"""
# The fence of a leader's transaction: the lease is still ours, read FOR KEY SHARE, which a
# renewal (a new expiry) does not wait for and a takeover (a new holder: a key column, by its
# unique index) does. So a takeover waits for the old holder's open transactions, and one the
# old holder opens after its expiry finds no row. A holder frozen inside such a transaction
# holds its successor off no longer than :idle ms: the server ends a session idle in it so long.
LEADER_FENCE = """
SELECT set_config('idle_in_transaction_session_timeout', :idle, true) FROM leader_leases
 WHERE name = :name AND holder = :holder AND expires_at > clock_timestamp()
   FOR KEY SHARE
"""
LEADER_RELEASE = "DELETE FROM leader_leases WHERE name = :name AND holder = :holder"
LEADER = (
    "SELECT holder, acquired_at, expires_at, expires_at > clock_timestamp() AS live "
    "FROM leader_leases WHERE name = :name"
)

PING = "SELECT 1"
# The status of each of these observers that has a row.
STATUSES = "SELECT id, status FROM observers WHERE id = ANY(:ids)"
PARAMS_OF = "SELECT id, params FROM observers WHERE id = ANY(:ids)"
# The server's settings the orchestrator shows (``manager/database_facts.py``).
AUTOVACUUM = "SELECT current_setting('autovacuum')"

# ---------------------------------------------------------------------- leader: retention
# Deleted observers (their history goes with them: ON DELETE CASCADE) older than :keep seconds.
PRUNE_OBSERVERS = f"""
DELETE FROM observers WHERE id IN (
    SELECT id FROM observers WHERE status = {_v(S.DELETED)}
       AND modified_at < now() - make_interval(secs => :keep) LIMIT :n)
RETURNING id
"""
# Dead services nobody refers to any more.
PRUNE_SERVICES = """
DELETE FROM services WHERE id IN (
    SELECT s.id FROM services s WHERE s.is_deleted
       AND s.modified_at < now() - make_interval(secs => :keep)
       AND NOT EXISTS (SELECT 1 FROM observers o WHERE o.service_id = s.id)
     LIMIT :n)
RETURNING id
"""
# Observers with history written in (:after, :newest], and more than :cap events. Both bounds
# given, so that even a generic plan reads the new events by the primary key, not the table.
HEAVY_HISTORIES = """
SELECT e.observer_id, max(e.id) AS newest FROM observer_events e
 WHERE e.observer_id IN (SELECT DISTINCT observer_id FROM observer_events
                          WHERE id > :after AND id <= :newest)
 GROUP BY e.observer_id HAVING count(*) > :cap
"""
# The oldest events of one observer beyond the newest :cap.
TRIM_HISTORY = """
DELETE FROM observer_events WHERE observer_id = :o AND id < (
    SELECT id FROM observer_events WHERE observer_id = :o ORDER BY id DESC OFFSET :cap - 1 LIMIT 1)
"""
NEWEST_EVENT = "SELECT coalesce(max(id), 0) FROM observer_events"

# ------------------------------------------------------------------------------ metrics
METRICS_OBSERVERS = (
    "SELECT status, kind, pool, CAST(sum(n) AS bigint) AS n FROM observer_counts "
    "GROUP BY status, kind, pool HAVING sum(n) <> 0"
)
METRICS_SERVICES = f"""
SELECT s.id, s.name, s.pool, s.worker_count, s.draining,
       EXTRACT(EPOCH FROM clock_timestamp() - s.last_heartbeat_at)::float8 AS heartbeat_age,
       {held_by("s.id")} AS running
  FROM services s WHERE {live_service("s")}
"""
METRICS_OUTBOX = "SELECT count(*), EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM outbox"

# Each pool's live services, the slots of those taking work, and what they run (``GET /pools``).
POOL_LOADS = f"""
SELECT s.pool, count(*) AS services,
       coalesce(sum(s.worker_count) FILTER (WHERE NOT s.draining), 0) AS slots,
       CAST(coalesce(sum({held_by("s.id")}), 0) AS bigint) AS running
  FROM services s WHERE {live_service("s")} GROUP BY s.pool
"""
# Live observers whose service is not live (the few services not live).
HELD_BY_THE_GONE = (
    "SELECT CAST(coalesce(sum(c.n), 0) AS bigint) FROM services s "
    f"JOIN observer_counts c ON c.service_id = s.id WHERE NOT {live_service('s')} "
    f"AND {sql_in('c.status', LIVE)}"
)
# The counts' rows folded into one per key (the triggers add a row or two per change), and
# keys counting nothing dropped. Keys already folded are left alone: an idle fleet's fold writes
# nothing, and leaves no dead rows behind for every count's index scan to step over.
FOLD_COUNTS = """
WITH loose AS (
    SELECT status, kind, pool, service_id FROM observer_counts
     GROUP BY status, kind, pool, service_id HAVING count(*) > 1 OR sum(n) = 0),
gone AS (
    DELETE FROM observer_counts c USING loose l
     WHERE c.status = l.status AND c.kind = l.kind AND c.pool = l.pool
       AND c.service_id IS NOT DISTINCT FROM l.service_id
 RETURNING c.status, c.kind, c.pool, c.service_id, c.n),
folded AS (
    INSERT INTO observer_counts (status, kind, pool, service_id, n)
    SELECT status, kind, pool, service_id, sum(n) FROM gone
     GROUP BY status, kind, pool, service_id HAVING sum(n) <> 0)
SELECT count(*) FROM gone
"""
# After a fold that dropped many rows: their index entries go too, at once rather than at the
# next autovacuum (up to a minute away), so that no count steps over them meanwhile. A role
# that does not own the table is warned by the server and nothing happens.
VACUUM_COUNTS = "VACUUM observer_counts"
STATUS_TOTALS = (
    "SELECT c.status, CAST(sum(c.n) AS bigint) AS n FROM observer_counts c GROUP BY c.status "
    "HAVING sum(c.n) <> 0"
)
# Live observers nobody holds, by pool.
UNHELD_BY_POOL = (
    "SELECT c.pool, CAST(sum(c.n) AS bigint) AS n FROM observer_counts c "
    f"WHERE c.service_id IS NULL AND {sql_in('c.status', LIVE)} GROUP BY c.pool "
    "HAVING sum(c.n) <> 0"
)

# ------------------------------------------------------------------ console views (api/views.py)
# The console's list: filters, one sort from VIEW_SORTS (a whitelist: {order} is never user
# text), server-side paging. :q matches any part of the name, :idp the start of the id, :id one
# observer, :params (JSON) is contained in the params; deleted observers only when asked for
# (or filtered on).
VIEW_FILTER = (
    "(CAST(:kind AS text) IS NULL OR o.kind = :kind) "
    "AND (CAST(:pool AS text) IS NULL OR o.pool = :pool) "
    "AND (CAST(:params AS jsonb) IS NULL OR o.params @> CAST(:params AS jsonb)) "
    "AND (CAST(:sid AS uuid) IS NULL OR o.service_id = :sid) "
    "AND (CAST(:id AS uuid) IS NULL OR o.id = :id) "
    r"AND (CAST(:q AS text) IS NULL OR o.name ILIKE '%' || :q || '%' ESCAPE '\' "
    "     OR (CAST(:idp AS text) IS NOT NULL AND CAST(o.id AS text) LIKE :idp)) "
)
VIEW_OBSERVERS = (
    "SELECT o.id, o.name, o.kind, o.status, o.service_id, s.name AS service_name, o.epoch, "
    "o.restart_count, o.restarted_at, o.restart_policy, o.last_error, "
    "o.checkpointed_at, o.created_at, o.modified_at, o.started_at, o.output_seq, "
    f"o.committed_at, o.pool, o.kind_version, {waiting_shown('o')} AS waiting, "
    # Only to mask an error that quotes them (one written before errors were masked at write).
    "CASE WHEN o.last_error IS NOT NULL THEN o.params END AS params, "
    "clock_timestamp() AS now "
    "FROM observers o LEFT JOIN services s ON s.id = o.service_id "
    f"WHERE {VIEW_FILTER}"
    "AND (CAST(:status AS text) IS NULL OR o.status = :status) "
    f"AND (:deleted OR CAST(:status AS text) IS NOT NULL OR o.status <> {_v(S.DELETED)}) "
    "ORDER BY {order} LIMIT :limit OFFSET :offset"
)
# NULLS LAST only where a value may be missing: on a column that is never null the order is
# plain, and an index on it serves the page both ways (``ix_observers_created_at``).
VIEW_NULLABLE = {"service", "checkpoint"}
VIEW_SORTS = {
    "name": "o.name",
    "kind": "o.kind",
    "pool": "o.pool",
    "status": "o.status",
    "service": "s.name",
    "epoch": "o.epoch",
    "restarts": "o.restart_count",
    "checkpoint": "o.checkpointed_at",
    "created": "o.created_at",
    "modified": "o.modified_at",
}
# Totals by status under the same filters (the status filter aside): the chips and the pager.
VIEW_TOTALS = (
    f"SELECT o.status, count(*) AS n FROM observers o WHERE {VIEW_FILTER}GROUP BY o.status"
)
# Takes, restarts and failures per minute since :since. History has no index on its time: the
# window starts after the newest event older than it, found walking the primary key backwards
# (events are written in time order), so this reads the window's events, not the table.
ACTIVITY_SINCE = "SELECT date_trunc('minute', now()) - make_interval(mins => :m - 1)"
ACTIVITY = f"""
WITH edge AS (
    SELECT COALESCE((SELECT e.id FROM observer_events e WHERE e.at < :since
                      ORDER BY e.id DESC LIMIT 1), 0) AS id)
SELECT date_trunc('minute', e.at) AS minute, e.event, count(*) AS n
  FROM observer_events e, edge
 WHERE e.id > edge.id AND e.at >= :since
   AND e.event IN ({_v(Event.TAKEN)}, {_v(Event.RESTARTED)}, {_v(Event.FAILED)})
   AND (CAST(:sid AS uuid) IS NULL OR e.service_id = :sid)
 GROUP BY 1, 2
"""


# ------------------------------------------------------------------- leader: the output relay
# Commits of outputs whose service is gone (deleted, or its lease expired) and nobody confirmed,
# or older than :grace seconds while another service, or none, holds the observer (the copy that
# committed them ended before their publish, say): per observer in seq order. A new holder of
# the observer publishes them too, before its own records: both publish in order, so a consumer
# sees repeats at worst, never a reorder. Each commit's observer is read by its key (as a join
# it was planned as a scan of every observer, on an idle fleet with no output at all).
OUTPUTS_LEFT = f"""
SELECT x.observer_id, x.seq, x.epoch, x.kind, x.name, CAST(x.records AS text) AS records,
       CAST(extract(epoch FROM x.committed_at) AS float8) AS committed_at
  FROM observer_outputs x LEFT JOIN services s ON s.id = x.service_id
 WHERE s.id IS NULL OR NOT {live_service("s")}
    OR (x.committed_at < clock_timestamp() - make_interval(secs => :grace)
        AND (SELECT o.service_id FROM observers o WHERE o.id = x.observer_id)
            IS DISTINCT FROM x.service_id)
 ORDER BY x.observer_id, x.seq LIMIT :n
"""
OUTPUTS_DELETE = """
DELETE FROM observer_outputs x
 USING unnest(CAST(:ids AS uuid[]), CAST(:seqs AS bigint[])) AS p(observer_id, seq)
 WHERE x.observer_id = p.observer_id AND x.seq = p.seq
"""
OUTPUTS_OLDEST = (
    "SELECT CAST(extract(epoch FROM clock_timestamp() - min(committed_at)) AS float8) "
    "FROM observer_outputs"
)
