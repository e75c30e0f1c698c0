"""The take rule: what a service does with a start message, decided from the locked row.

Pure so that every branch has a unit test; ``store.take`` supplies the facts in one transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import Enum

from contracts.statuses import ObserverStatus


class Decision(Enum):
    TAKE = "take"
    DROP_MISSING = "drop: no such observer"
    DROP_STALE = "drop: stale dispatch"
    DROP_DELETED = "drop: deleted (marked deleted)"
    DROP_DELETING_ELSEWHERE = "drop: being deleted by its holder"
    DROP_FAILED = "drop: failed"
    DROP_DUPLICATE = "drop: duplicate of a running copy"
    WAIT = "wait: held by a live service"


@dataclass(frozen=True)
class Facts:
    """What the take transaction knows about the observer and its current holder."""

    exists: bool
    status: ObserverStatus | None = None
    dispatch_current: bool = False
    holder: uuid.UUID | None = None
    holder_live: bool = False  # its lease has not expired and it is not deleted
    holder_gone: bool = False  # its Postgres session ended (its advisory lock is free)


def decide(
    facts: Facts,
    *,
    me: uuid.UUID,
    redelivered: bool,
    running_here_on_open_channel: bool,
) -> Decision:
    if not facts.exists:
        return Decision.DROP_MISSING
    if not facts.dispatch_current:
        return Decision.DROP_STALE
    if facts.status is ObserverStatus.FAILED:
        return Decision.DROP_FAILED
    holder_is_other_and_live = facts.holder not in (None, me) and facts.holder_live
    if facts.status in (ObserverStatus.ON_DELETING, ObserverStatus.DELETED):
        if facts.status is ObserverStatus.ON_DELETING and holder_is_other_and_live:
            return Decision.DROP_DELETING_ELSEWHERE
        return Decision.DROP_DELETED
    # created or processing
    if facts.holder is None:
        return Decision.TAKE
    if facts.holder == me:
        return Decision.DROP_DUPLICATE if running_here_on_open_channel else Decision.TAKE
    if not facts.holder_live:
        return Decision.TAKE
    # Held by another live service. A first delivery can only be a duplicate publish: the
    # holder's own delivery is still unacked on its channel. A redelivery means the broker saw
    # the holder's channel close: the holder is gone, or cut off and stopping its copy.
    if not redelivered:
        return Decision.DROP_DUPLICATE
    return Decision.TAKE if facts.holder_gone else Decision.WAIT
