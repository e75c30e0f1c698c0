"""What the manager knows of the PostgreSQL it runs on: the server's settings that change what
the orchestrator can promise, read at start and every ``EVERY`` seconds, shown by ``/healthz``.

- ``autovacuum``: off (as some images ship it), the tables the orchestrator churns (observers,
  history, outbox, outputs, counts) keep their dead rows until someone vacuums them: they grow,
  and so does every read of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from manager import queries as q
from manager.store import ManagerStore

log = logging.getLogger(__name__)
#: Seconds between two reads.
EVERY = 60.0


@dataclass(frozen=True)
class DatabaseFacts:
    #: None: not read yet (the database has not answered since the start).
    autovacuum: bool | None = None

    def warnings(self) -> list[str]:
        out = []
        if self.autovacuum is False:
            out.append(
                "autovacuum is off on the database server: the orchestrator's tables keep their "
                "dead rows and grow until vacuumed; turn it on, or vacuum them on a schedule"
            )
        return out

    def shown(self) -> dict[str, object]:
        return {
            "autovacuum": None if self.autovacuum is None else ("on" if self.autovacuum else "off")
        }


async def read(store: ManagerStore) -> DatabaseFacts:
    """The facts as the server says now (raises Transient when it cannot answer)."""
    async with store.autocommit() as tx:
        autovacuum = await tx.value(q.AUTOVACUUM)
    facts = DatabaseFacts(autovacuum=autovacuum == "on")
    for warning in facts.warnings():
        log.warning("%s", warning)
    return facts
