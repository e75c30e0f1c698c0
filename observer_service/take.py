"""The take rule: what a service does with a start message, decided from the observer's row.

Pure so that every branch has a unit test; ``taking.take_many`` supplies the facts and writes the
decision with a compare-and-set.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import Enum

from orch_contracts.statuses import STOPPING, ObserverStatus


class Decision(Enum):
    TAKE = "take"
    DROP_MISSING = "drop: no such observer"
    DROP_STALE = "drop: stale dispatch"
    DROP_DELETED = "drop: deleted"
    DROP_PAUSED = "drop: paused"
    DROP_FAILED = "drop: failed"
    DROP_DUPLICATE = "drop: duplicate of a running copy"
    DROP_STOPPING_ELSEWHERE = "drop: being stopped by its holder"
    #: Being deleted or paused, and nobody runs it: complete that (deleted, paused), then drop.
    COMPLETE_STOP = "drop: its stop completed here"
    WAIT = "wait: held by a live service"
    #: It may be taken, but this start holds no slot: wait for one, then decide again.
    NO_ROOM = "wait: no free slot"
    #: The holder's database session has ended; ask the broker whether its process is gone too.
    PROBE = "probe: is the holder gone from the broker too?"
    #: It belongs to another pool, or its kind is not installed here: passed on to the leader,
    #: which sends it to a service of its pool that runs the kind (or shows it waiting for
    #: one). Never taken here, never failed for it.
    NOT_HERE = "pass: another pool's, or its kind is not installed here"


#: The decisions a take writes, each with a compare-and-set on the row as it was seen.
WRITES = frozenset({Decision.TAKE, Decision.COMPLETE_STOP})


@dataclass(frozen=True)
class Facts:
    """What the take statement knows about the observer and its current holder."""

    exists: bool
    status: ObserverStatus | None = None
    dispatch_current: bool = False
    holder: uuid.UUID | None = None
    #: Its lease has not expired in the database and it is not deleted.
    holder_live: bool = False
    #: Its lease session has ended: the advisory lock that session held is free.
    holder_lock_free: bool = False
    #: Its exclusive control queue is gone from the broker (None: not asked yet).
    holder_off_broker: bool | None = None
    #: It may run here: its pool is this service's and its kind is installed here.
    belongs_here: bool = True


def decide(
    facts: Facts,
    *,
    me: uuid.UUID,
    redelivered: bool,
    running_here: bool,
    room: bool = True,
) -> Decision:
    """``running_here``: a copy of this observer runs in this process (not being stopped).
    ``room``: a slot is held for this start; a take without one is answered NO_ROOM.

    A holder other than me whose lease is live may be taken over before its lease expires only
    when its process is provably gone: its database session ended (the lock is free) *and* its
    broker connection closed (its exclusive control queue is gone). Either alone happens to a
    live process (a pooler, a database restart, a broker restart, a partition), and that
    process goes on with its copies; a holder that sees its session end pauses them until a
    new session shows which are still its (``lease.py``), and the take's compare-and-set holds
    only while the holder's row still names the lock key found free.
    """
    if not facts.exists:
        return Decision.DROP_MISSING
    if not facts.dispatch_current and not _stale_may_run(facts, me=me, running_here=running_here):
        return Decision.DROP_STALE
    if facts.status is ObserverStatus.FAILED:
        return Decision.DROP_FAILED
    if facts.holder == me and running_here:
        return Decision.DROP_DUPLICATE
    if facts.status is ObserverStatus.DELETED:
        return Decision.DROP_DELETED
    if facts.status is ObserverStatus.PAUSED:
        return Decision.DROP_PAUSED
    other_live = facts.holder not in (None, me) and facts.holder_live
    if facts.status in STOPPING:
        return Decision.DROP_STOPPING_ELSEWHERE if other_live else Decision.COMPLETE_STOP
    # created or processing
    if not facts.belongs_here:
        return Decision.DROP_DUPLICATE if other_live and not redelivered else Decision.NOT_HERE
    take = Decision.TAKE if room else Decision.NO_ROOM
    if not other_live:
        return take
    # Held by another live service. A first delivery can only be a duplicate publish: the
    # holder's own delivery is still unacked on its channel. A redelivery means the holder's
    # channel closed: its process crashed (its lock is about to be free), or it goes on without
    # that delivery (a broker restart, a partition): then this is a duplicate, after a wait.
    if not redelivered:
        return Decision.DROP_DUPLICATE
    if not facts.holder_lock_free:
        return Decision.WAIT
    if facts.holder_off_broker is None:
        return Decision.PROBE
    return take if facts.holder_off_broker else Decision.WAIT


def _stale_may_run(facts: Facts, *, me: uuid.UUID, running_here: bool) -> bool:
    """A start whose dispatch was replaced may still start an observer that nobody runs: the
    newer start has not been taken (it may be unpublished while the broker blocks publishers,
    or waiting at a service with no room), and the take is a compare-and-set on the epoch, so
    whichever start comes first runs it, once. Dropping it instead left the observer unrun until
    the newer start got through (a whole broker alarm), or for ever where the leader kept
    replacing the starts in flight."""
    if facts.status not in (ObserverStatus.CREATED, ObserverStatus.PROCESSING):
        return False
    if not facts.belongs_here:
        return False
    if facts.holder == me:
        return not running_here
    return facts.holder is None or not facts.holder_live


class Departed:
    """Holder sessions proven over, by lock key; no two sessions ever share a key.

    Both proofs stay true for ever, so one proof serves every later start held under that key:
    ``ended``, the key's lock was free once (that database session is over and cannot come
    back); ``gone``, ended and then off the broker as well (its process fences itself and never
    runs anything under that key again; a rejoin takes a new key). A busy moment that makes the
    lock look held (another taker trying it at the same instant) cannot undo either proof.
    """

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._ended: dict[int, None] = {}
        self._gone: dict[int, None] = {}

    def _note(self, keys: dict[int, None], key: int) -> None:
        keys[key] = None
        if len(keys) > self._limit:
            del keys[next(iter(keys))]  # the oldest proof; a miss only costs a probe

    def lock_freed(self, key: int) -> None:
        self._note(self._ended, key)

    def off_broker(self, key: int) -> None:
        self.lock_freed(key)
        self._note(self._gone, key)

    def facts(self, key: int | None, *, lock_free: bool) -> tuple[bool, bool | None]:
        """(holder_lock_free, holder_off_broker) for a holder under ``key``, given what the
        statement saw of its lock now; records a free lock."""
        if key is None:
            return lock_free, None
        if lock_free:
            self.lock_freed(key)
        return key in self._ended, (True if key in self._gone else None)
