"""The randomized fault run: ``orch verify``'s engine over two managers and three services running
recorders, judged from the witness the services write and, as a second witness, from the
recorders' own tick logs.

``scripts/test`` runs one fixed seed; ``scripts/chaos`` runs a campaign of seeds by hand.
Replay a failure with ``ORCH_CHAOS_SEED=<seed> pytest tests/acceptance/test_chaos.py -s``.
"""

from __future__ import annotations

import os

import pytest

from orch_verify.campaign import ObserverSpec, parse_faults
from orch_verify.run import Options, campaign_on
from tests.support.cluster import Cluster
from tests.support.faults import assert_no_overlap

#: It needs the machine, or the shared servers, to itself.
pytestmark = pytest.mark.alone


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_random_faults_keep_the_promise(cluster: Cluster) -> None:
    seed = int(os.environ.get("ORCH_CHAOS_SEED", "20261130"))
    seconds = float(os.environ.get("ORCH_CHAOS_SECONDS", "35"))  # scripts/chaos: 60
    witness_dir = cluster.workdir / "witness"
    cluster.env["ORCH_WITNESS_DIR"] = str(witness_dir)
    cluster.env["ORCH_SHUTDOWN_TIMEOUT"] = "2"
    ticks = str(cluster.tick_dir)
    options = Options(
        kind_modules=["tests.support.kinds"],
        observers=[
            ObserverSpec("recorder", {"dir": ticks, "interval": 0.05, "checkpoint_every": 5}, 15),
            ObserverSpec("recorder", {"dir": ticks, "interval": 0.1, "checkpoint_every": 1}, 15),
        ],
        seconds=seconds,
        seed=seed,
        weights=parse_faults(None, broker_restart=True),
        shutdown_timeout=2,
    )
    outcome = await campaign_on(cluster, options, witness_dir, lambda line: print(line, flush=True))
    lines = outcome.verdict.lines()
    print("\n".join(lines), flush=True)
    assert outcome.verdict.passed, f"seed {seed}:\n" + "\n".join(lines)
    assert outcome.verdict.failed == {}, f"seed {seed}: failed observers"
    # What the recorders themselves wrote agrees (a tick cut by a SIGSTOP, as the witness's).
    assert_no_overlap(cluster.tick_dir, outcome.campaign.paused)
