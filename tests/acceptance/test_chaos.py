"""The randomized fault run: a seeded schedule of process, database, broker and operator faults
over two managers and three services, judged from the observers' own tick logs.

``scripts/test`` runs one fixed seed; ``scripts/chaos`` runs a campaign of seeds by hand.
Replay a failure with ``ORCH_CHAOS_SEED=<seed> pytest tests/acceptance/test_chaos.py -s``.
"""

from __future__ import annotations

import os

import pytest

from tests.support.chaos import Chaos
from tests.support.cluster import Cluster


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_random_faults_keep_the_promise(cluster: Cluster) -> None:
    seed = int(os.environ.get("ORCH_CHAOS_SEED", "20261130"))
    seconds = float(os.environ.get("ORCH_CHAOS_SECONDS", "60"))
    chaos = Chaos(cluster, seed)
    chaos.note(f"seed {seed}, {seconds:.0f}s of faults")
    try:
        await chaos.start()
        await chaos.run(seconds)
        await chaos.heal()
    finally:
        await chaos.start_broker()
    await chaos.verify()
