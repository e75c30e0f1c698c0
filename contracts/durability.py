"""What a failover of the database can lose: its replication, as the primary sees it, read by
the manager (``manager/database_facts.py``, shown by ``/healthz`` and ``/metrics``) and by each
service at start.

``synchronous``: a commit waits for a standby, a promoted standby has every acknowledged write.
``asynchronous``: standbys lag (``lag`` seconds when read): a failover to one loses that tail,
acknowledged creates and deletes, takes and checkpoints with it (``docs/protocol.md``'s
failure model says what still holds then). ``single``: no standby at all. ``standby``: the
server is in recovery (read-only). With ``ORCH_REQUIRE_SYNCHRONOUS_REPLICATION`` the manager and
the services refuse to start on anything but ``synchronous``, and the manager's ``/readyz``
fails while it is not.

``timeline``: the server's WAL timeline, which a promotion always raises (the epochs carry it:
no fencing token goes back after a failover).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orch_contracts.errors import StartupError

#: The server's timeline, from the name of its current WAL file (a primary's only).
TIMELINE = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"
#: What a failover can lose; a standby has no timeline here.
REPLICATION = f"""
SELECT pg_is_in_recovery() AS standby,
       current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('synchronous_standby_names') AS synchronous_standby_names,
       (SELECT count(*) FROM pg_stat_replication) AS standbys,
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum'))
           AS synchronous_standbys,
       (SELECT extract(epoch FROM max(replay_lag)) FROM pg_stat_replication)::float8 AS lag,
       CASE WHEN NOT pg_is_in_recovery()
            THEN {TIMELINE}
       END AS timeline
"""
#: synchronous_commit values that wait for a synchronous standby.
WAITS_FOR_STANDBY = frozenset({"on", "remote_write", "remote_apply"})


@dataclass(frozen=True)
class Replication:
    standby: bool = False
    synchronous_commit: str = ""
    synchronous_standby_names: str = ""
    standbys: int = 0
    synchronous_standbys: int = 0
    #: Seconds the slowest standby's replay lags (None: unknown, or no standby).
    lag: float | None = None
    timeline: int | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Replication:
        return cls(
            standby=bool(row["standby"]),
            synchronous_commit=str(row["synchronous_commit"]),
            synchronous_standby_names=str(row["synchronous_standby_names"]),
            standbys=int(row["standbys"]),
            synchronous_standbys=int(row["synchronous_standbys"]),
            lag=None if row["lag"] is None else float(row["lag"]),
            timeline=None if row["timeline"] is None else int(row["timeline"]),
        )

    @property
    def durability(self) -> str:
        if self.standby:
            return "standby"
        if (
            self.synchronous_standbys
            and self.synchronous_standby_names.strip()
            and self.synchronous_commit in WAITS_FOR_STANDBY
        ):
            return "synchronous"
        return "asynchronous" if self.standbys else "single"

    def warnings(self) -> list[str]:
        if self.durability == "asynchronous":
            lag = "" if self.lag is None else f" (its standbys lag {self.lag:.1f} s now)"
            return [
                "the database replicates asynchronously: a failover to a standby loses the "
                f"writes it had not replayed{lag}, acknowledged creates and deletes among them; "
                "make a standby synchronous (synchronous_standby_names), see docs/scaling.md"
            ]
        if self.durability == "standby":
            return ["the database server is a standby in recovery: it takes no write"]
        return []

    def require(self, synchronous: bool) -> None:
        """StartupError where synchronous replication is required and this lacks it."""
        if synchronous and self.durability != "synchronous":
            raise StartupError(
                "ORCH_REQUIRE_SYNCHRONOUS_REPLICATION is set, and the database's durability is "
                f"{self.durability}: a failover could lose acknowledged writes. Give it a "
                "synchronous standby (synchronous_standby_names, synchronous_commit = on), or "
                "unset the requirement"
            )
