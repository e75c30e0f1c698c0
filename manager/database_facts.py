"""What the manager knows of the PostgreSQL it runs on: the server's settings that change what
the orchestrator can promise, read at start and every ``EVERY`` seconds, shown by ``/healthz``
and ``/metrics``.

- ``autovacuum``: off (as some images ship it), the tables the orchestrator churns (observers,
  history, outbox, outputs, counts) keep their dead rows until someone vacuums them: they grow,
  and so does every read of them.
- its replication (``contracts/durability.py``): what a failover of the database can lose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orch_contracts.durability import REPLICATION, Replication
from orch_manager import queries as q
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)
#: Seconds between two reads.
EVERY = 60.0


@dataclass(frozen=True)
class DatabaseFacts:
    #: None: not read yet (the database has not answered since the start).
    autovacuum: bool | None = None
    replication: Replication | None = None

    @property
    def durability(self) -> str | None:
        return None if self.replication is None else self.replication.durability

    def warnings(self) -> list[str]:
        out = []
        if self.autovacuum is False:
            out.append(
                "autovacuum is off on the database server: the orchestrator's tables keep their "
                "dead rows and grow until vacuumed; turn it on, or vacuum them on a schedule"
            )
        if self.replication is not None:
            out += self.replication.warnings()
        return out

    def shown(self) -> dict[str, object]:
        r = self.replication
        return {
            "autovacuum": None if self.autovacuum is None else ("on" if self.autovacuum else "off"),
            "durability": self.durability,
            "standbys": None if r is None else r.standbys,
            "synchronous_standbys": None if r is None else r.synchronous_standbys,
            "replication_lag_seconds": None if r is None else r.lag,
            "timeline": None if r is None else r.timeline,
        }


async def read(store: ManagerStore) -> DatabaseFacts:
    """The facts as the server says now (raises Transient when it cannot answer)."""
    async with store.autocommit() as tx:
        autovacuum = await tx.value(q.AUTOVACUUM)
        row = await tx.row(REPLICATION)
    assert row is not None
    facts = DatabaseFacts(autovacuum=autovacuum == "on", replication=Replication.of(row))
    for warning in facts.warnings():
        log.warning("%s", warning)
    return facts
