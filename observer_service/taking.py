"""The take loop, once for every store: read the facts of a batch of starts, decide each with
the take rule, compare-and-set the decisions that write, and read again what changed between.

A store supplies only the two statements (``ports.TakeRows``), so the unit tests drive the same
loop through the in-memory store as the services run on PostgreSQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from observer_service.ports import LOCKED, Locked, Seen, StartRequest, Taken, TakeResult, TakeRows
from observer_service.take import WRITES, Decision, Departed, Facts, decide

#: Reads of one batch at most: a row that changed before every compare-and-set is answered
#: LOCKED, as a skipped row is (written again alone), so a hot row never holds the batch up.
ROUNDS = 4


async def take_many(
    rows: TakeRows,
    requests: Sequence[StartRequest],
    departed: Departed,
    *,
    rounds: int = ROUNDS,
    kinds: Mapping[str, str] | None = None,
    pool: str | None = None,
) -> list[TakeResult | Locked]:
    """Decide on every start with one read, then write every take (and every completed stop)
    with one compare-and-set each; a row that changed in between is read and decided again, at
    most ``rounds`` reads in all. ``departed``: holder sessions proven over, updated with every
    lock found free. ``kinds``: the kinds installed here, each with its version (None: every
    kind); ``pool``: this service's (None: any)."""
    results: dict[int, TakeResult | Locked] = {}
    todo = list(enumerate(requests))
    for _ in range(rounds):
        if not todo:
            break
        seen = await rows.read_facts([r.observer_id for _, r in todo])
        writes: dict[Decision, list[tuple[int, StartRequest, Seen]]] = {d: [] for d in WRITES}
        for i, req in todo:
            row = seen.get(req.observer_id)
            decision = decide(
                facts(row, req, rows.me, departed, kinds, pool),
                me=rows.me,
                redelivered=req.redelivered,
                running_here=req.running_here,
                room=req.room,
            )
            if row is not None and decision in writes:
                writes[decision].append((i, req, row))
                continue
            results[i] = TakeResult(
                decision,
                kind=None if row is None else row.kind,
                pool=None if row is None else row.pool,
                kind_version=None if row is None else row.kind_version,
                holder=None if row is None else row.holder,
                holder_key=None if row is None else row.holder_key,
                holder_remaining=0.0 if row is None else row.holder_remaining,
            )
        todo = []
        for decision in (Decision.TAKE, Decision.COMPLETE_STOP):
            batch = writes[decision]
            if not batch:
                continue
            written = await rows.compare_and_set(
                decision,
                [row for _, _, row in batch],
                queued={req.observer_id for _, req, _ in batch if req.queued},
                dispatches={req.observer_id: req.start.dispatch_id for _, req, _ in batch},
            )
            for i, req, row in batch:
                epoch = written.epochs.get(row.observer_id)
                if epoch is not None:
                    taken = (
                        _taken(row, epoch, req, written.resumed.get(row.observer_id))
                        if decision is Decision.TAKE
                        else None
                    )
                    results[i] = TakeResult(decision, taken)
                elif row.observer_id in written.locked:
                    results[i] = LOCKED  # as seen, but locked: not decided again here
                else:
                    todo.append((i, req))  # changed meanwhile: decide again
    for i, _ in todo:
        results[i] = LOCKED  # changed before each write: the caller writes it again alone
    return [results[i] for i in range(len(requests))]


def facts(
    row: Seen | None,
    req: StartRequest,
    me: uuid.UUID,
    departed: Departed,
    kinds: Mapping[str, str] | None = None,
    pool: str | None = None,
) -> Facts:
    """The take rule's facts about ``row`` for ``req``; a lock found free is recorded in
    ``departed``, and what was proven there before counts as well. ``kinds``: those installed
    here, each with its version (None: every kind); ``pool``: this service's (None: any)."""
    if row is None:
        return Facts(exists=False)
    other = row.holder not in (None, me)
    lock_free, off_broker = departed.facts(
        row.holder_key if other else None, lock_free=row.holder_lock_free
    )
    return Facts(
        exists=True,
        status=row.status,
        dispatch_current=row.dispatch_id == req.start.dispatch_id,
        holder=row.holder,
        holder_live=row.holder_live,
        holder_lock_free=lock_free,
        holder_off_broker=off_broker,
        belongs_here=runs_here(row, kinds, pool),
    )


def runs_here(row: Seen, kinds: Mapping[str, str] | None, pool: str | None) -> bool:
    """Whether ``row`` may run on a service of ``pool`` with ``kinds`` (name: version): its
    pool, its kind, and the version it is pinned to, if any."""
    if pool not in (None, row.pool):
        return False
    if kinds is None:
        return True
    return row.kind in kinds and row.kind_version in (None, kinds[row.kind])


def _taken(
    row: Seen, epoch: int, req: StartRequest, resumed: tuple[Any, int] | None = None
) -> Taken:
    """The copy a take made; ``resumed``: its checkpoint and last output seq as the take's write
    found them (else as the facts read saw them)."""
    checkpoint, output_seq = resumed if resumed is not None else (row.checkpoint, 0)
    return Taken(
        observer_id=row.observer_id,
        name=row.name,
        kind=row.kind,
        params=row.params,
        checkpoint=checkpoint,
        restart_policy=row.restart_policy,
        epoch=epoch,
        dispatch_id=req.start.dispatch_id,
        output_seq=output_seq,
    )
