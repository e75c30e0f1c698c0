"""Observer statuses and history events, shared by the API, the services and the database, and
the SQL conditions built from them (never spelled out as literals in queries)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class ObserverStatus(StrEnum):
    CREATED = "created"
    PROCESSING = "processing"
    ON_DELETING = "on_deleting"
    DELETED = "deleted"
    FAILED = "failed"
    PAUSING = "pausing"
    PAUSED = "paused"


#: Its holder is stopping it; what it becomes once the copy has stopped.
STOPPED = {
    ObserverStatus.ON_DELETING: ObserverStatus.DELETED,
    ObserverStatus.PAUSING: ObserverStatus.PAUSED,
}
STOPPING = frozenset(STOPPED)
#: Held by a copy that runs, or is being stopped by its holder.
HELD = frozenset({ObserverStatus.PROCESSING, *STOPPING})
#: Should be running somewhere.
LIVE = frozenset({ObserverStatus.CREATED, ObserverStatus.PROCESSING})
#: No copy is meant to run and none starts until asked: its params may be edited (a failed
#: row's last copy may still be stopping on a service that has not seen the failure yet).
EDITABLE = frozenset({ObserverStatus.PAUSED, ObserverStatus.FAILED})


class Event(StrEnum):
    """One line of an observer's history (``observer_events.event``)."""

    CREATED = "created"
    TAKEN = "taken"
    RELEASED = "released"
    REDISPATCHED = "redispatched"
    HANDOFF_REQUESTED = "handoff requested"
    RESTARTED = "restarted"
    FAILED = "failed"
    RESTART_REQUESTED = "restart requested"
    DELETING = "deleting"
    DELETED = "deleted"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMED = "resumed"
    MOVE_REQUESTED = "move requested"
    PARAMS_EDITED = "params edited"


def sql_in(column: str, statuses: Iterable[ObserverStatus]) -> str:
    """``column IN ('a', 'b')`` for a set of statuses (sorted, so queries are stable)."""
    return f"{column} IN ({', '.join(repr(s.value) for s in sorted(statuses))})"


def sql_stopped(column: str) -> str:
    """What ``column`` becomes once its holder's copy has stopped: on_deleting → deleted,
    pausing → paused, anything else as it is."""
    cases = " ".join(f"WHEN '{a.value}' THEN '{b.value}'" for a, b in STOPPED.items())
    return f"CASE {column} {cases} ELSE {column} END"


def live_service(alias: str) -> str:
    """The service row ``alias`` is alive: not deleted and its lease not expired."""
    return f"(NOT {alias}.is_deleted AND {alias}.lease_expires_at > clock_timestamp())"


def held_by(service: str) -> str:
    """How many observers the service whose id is the SQL ``service`` holds: the sum of its
    rows in ``observer_counts`` (kept by triggers on ``observers``), read by its holder index."""
    return (
        "(SELECT CAST(coalesce(sum(c.n), 0) AS bigint) FROM observer_counts c "
        f"WHERE c.service_id = {service} AND {sql_in('c.status', HELD)})"
    )
