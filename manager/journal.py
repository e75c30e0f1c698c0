"""What this manager acknowledged lately, kept to make it good after a database failover that
lost the last writes (an asynchronous standby promoted: ``contracts/durability.py``).

Each replica keeps, for ``KEEP`` seconds, the deletes and pauses it answered and the observers
it created. It reads the database's timeline every ``EVERY`` seconds; a promotion raises it.
Then:

- a delete or a pause the new primary lacks is applied again (the row is live again, its copy
  may be running): the observer is stopped as it was promised, within a timeline read and a
  cancel of the failover;
- a create the new primary lacks is reported: logged, counted
  (``orch_failover_lost_creates_total``) and shown by ``/healthz`` for an hour, with the ids
  and names. Its client may create it again under the same name;
- an edit of params the new primary lacks is reported the same way (logged, in ``/healthz``):
  its observer runs with its old params until edited again.

A change acknowledged later supersedes the one kept: a pause then a resume keeps nothing to
apply again (applied, it stopped an observer its user had resumed).

The journal is in memory: a replica that crashes with the database loses its part. Under
synchronous replication there is nothing to make good; this is the best an asynchronous one
allows.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from orch_contracts.durability import TIMELINE
from orch_contracts.errors import OrchError
from orch_contracts.statuses import ObserverStatus
from orch_manager import repository as repo
from orch_manager.outbox import Outbox, Pending
from orch_manager.store import ManagerStore, Tx

log = logging.getLogger(__name__)
#: Seconds an acknowledged change is kept (far more than any standby's lag).
KEEP = 600.0
#: Seconds between two reads of the timeline.
EVERY = 1.0
#: Seconds a report of lost creates stays in ``/healthz``.
SHOWN = 3600.0
_TIMELINE_NOW = f"SELECT {TIMELINE}"


Change = Callable[[Tx, uuid.UUID], Awaitable[tuple[dict[str, Any], list[Pending]]]]
#: The statuses each kept change leaves the row in (or is on its way to).
_DONE = {
    "delete": frozenset({ObserverStatus.ON_DELETING, ObserverStatus.DELETED}),
    "pause": frozenset(
        {
            ObserverStatus.PAUSING,
            ObserverStatus.PAUSED,
            ObserverStatus.ON_DELETING,
            ObserverStatus.DELETED,
        }
    ),
}
_APPLY: dict[str, Change] = {"delete": repo.delete_observer, "pause": repo.pause_observer}


@dataclass
class Journal:
    store: ManagerStore
    outbox: Outbox
    #: Observer -> (the change acknowledged, when; monotonic).
    changes: dict[uuid.UUID, tuple[str, float]] = field(default_factory=dict)
    #: Observer -> (its name, when; monotonic).
    created: dict[uuid.UUID, tuple[str, float]] = field(default_factory=dict)
    timeline: int | None = None
    #: Observer -> (its name, the params an edit gave it, when; monotonic).
    edited: dict[uuid.UUID, tuple[str, Any, float]] = field(default_factory=dict)
    #: Creates lost in the last failover: (when; wall time, id, name).
    lost: list[tuple[float, uuid.UUID, str]] = field(default_factory=list)
    #: Edits lost in the last failover: (when; wall time, id, name).
    lost_edits: list[tuple[float, uuid.UUID, str]] = field(default_factory=list)
    on_lost: Callable[[int], None] = lambda n: None

    def changed(self, observer_id: uuid.UUID, what: str) -> None:
        """A change of ``observer_id`` was acknowledged: a delete or a pause is kept; any other
        (a resume, a restart) supersedes the one kept."""
        if what in _APPLY:
            self.changes[observer_id] = (what, time.monotonic())
        else:
            self.changes.pop(observer_id, None)

    def params_edited(self, row: dict[str, Any]) -> None:
        """An edit of this observer's params was acknowledged: ``row`` as it answered."""
        oid = uuid.UUID(str(row["id"]))
        self.edited[oid] = (str(row["name"]), row["params"], time.monotonic())

    def made(self, rows: list[dict[str, Any]]) -> None:
        """These observers' creates were acknowledged."""
        now = time.monotonic()
        for row in rows:
            self.created[uuid.UUID(str(row["id"]))] = (str(row["name"]), now)

    def warnings(self) -> list[str]:
        out = []
        for lost, what, fix in (
            (self.lost, "creates", "create them again"),
            (self.lost_edits, "edits of params", "edit them again"),
        ):
            recent = [(at, oid, name) for at, oid, name in lost if time.time() - at < SHOWN]
            if not recent:
                continue
            shown = ", ".join(f"{name} ({oid})" for _, oid, name in recent[:20])
            more = f" and {len(recent) - 20} more" if len(recent) > 20 else ""
            out.append(
                f"a failover of the database lost {len(recent)} acknowledged {what}: "
                f"{shown}{more}; {fix}"
            )
        return out

    async def once(self) -> None:
        """Read the timeline; after a change, make good what this replica acknowledged."""
        self._forget(time.monotonic())
        async with self.store.autocommit() as tx:
            timeline = int(await tx.value(_TIMELINE_NOW))
        before, self.timeline = self.timeline, timeline
        if before is None or timeline == before:
            return
        log.warning(
            "the database failed over (timeline %d to %d): checking what this manager "
            "acknowledged lately",
            before,
            timeline,
        )
        await self._reapply()
        await self._report_lost()
        await self._report_lost_edits()

    def _forget(self, now: float) -> None:
        self.changes = {o: c for o, c in self.changes.items() if now - c[1] < KEEP}
        self.created = {o: c for o, c in self.created.items() if now - c[1] < KEEP}
        self.edited = {o: e for o, e in self.edited.items() if now - e[2] < KEEP}

    async def _reapply(self) -> None:
        async with self.store.autocommit() as tx:
            statuses = await repo.statuses(tx, list(self.changes))
        again = [
            (oid, what)
            for oid, (what, _) in self.changes.items()
            if oid in statuses and statuses[oid] not in _DONE[what]
        ]
        pending: list[Pending] = []
        for oid, what in again:
            try:
                async with self.store.transaction() as tx:
                    _, published = await _APPLY[what](tx, oid)
            except OrchError as exc:  # a transient error goes up: the next read retries
                log.warning("observer %s: its %s could not be applied again: %s", oid, what, exc)
                continue
            pending += published
        if again:
            log.error(
                "the failover lost %d deletes or pauses this manager had acknowledged: "
                "applied again (%s)",
                len(again),
                ", ".join(f"{what} {oid}" for oid, what in again[:20]),
            )
        self.outbox.publish_soon(pending)

    async def _report_lost(self) -> None:
        async with self.store.autocommit() as tx:
            statuses = await repo.statuses(tx, list(self.created))
        lost = [(oid, name) for oid, (name, _) in self.created.items() if oid not in statuses]
        self._lost(lost, self.created, self.lost, "creates", "their clients may create them again")
        if lost:
            self.on_lost(len(lost))

    async def _report_lost_edits(self) -> None:
        async with self.store.autocommit() as tx:
            now_params = await repo.params_of(tx, list(self.edited))
        lost = [
            (oid, name)
            for oid, (name, params, _) in self.edited.items()
            if oid in now_params and now_params[oid] != params
        ]
        self._lost(
            lost,
            self.edited,
            self.lost_edits,
            "edits of params",
            "their observers have their old params; edit them again",
        )

    def _lost(
        self,
        lost: list[tuple[uuid.UUID, str]],
        kept: dict[uuid.UUID, Any],
        into: list[tuple[float, uuid.UUID, str]],
        what: str,
        fix: str,
    ) -> None:
        """Acknowledged changes (``lost``: id, name) the failover lost: no longer kept, shown by
        ``warnings`` from ``into``, and logged."""
        if not lost:
            return
        now = time.time()
        into += [(now, oid, name) for oid, name in lost]
        for oid, _ in lost:
            kept.pop(oid, None)
        log.error(
            "the failover lost %d %s this manager had acknowledged (%s): %s",
            len(lost),
            what,
            fix,
            ", ".join(f"{name} ({oid})" for oid, name in lost[:20]),
        )
