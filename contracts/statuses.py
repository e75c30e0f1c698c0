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


#: Held by a copy that runs, or is being stopped by its holder.
HELD = frozenset({ObserverStatus.PROCESSING, ObserverStatus.ON_DELETING})
#: Should be running somewhere.
LIVE = frozenset({ObserverStatus.CREATED, ObserverStatus.PROCESSING})
#: What a holder's stop turns a status into once its copy has stopped.
STOPPED = {ObserverStatus.ON_DELETING: ObserverStatus.DELETED}


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


def sql_in(column: str, statuses: Iterable[ObserverStatus]) -> str:
    """``column IN ('a', 'b')`` for a set of statuses (sorted, so queries are stable)."""
    return f"{column} IN ({', '.join(repr(s.value) for s in sorted(statuses))})"


def live_service(alias: str) -> str:
    """The service row ``alias`` is alive: not deleted and its lease not expired."""
    return f"(NOT {alias}.is_deleted AND {alias}.lease_expires_at > clock_timestamp())"
