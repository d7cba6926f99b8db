"""A Redis Cluster master cut off from the majority while the worker and the trainer still reach
it and keep writing to it (bench/partition_cluster.py): with ``--durability replicated`` no step
the trainer was told is committed is missing once the cluster heals, and every session steps on.
With the default (``async``) the steps the old master took alone are lost at the heal; the count
is printed, not asserted (docs/network-faults.md)."""

from __future__ import annotations

import pytest

from bench.netns import missing_tools
from bench.partition_cluster import HEADER, SESSIONS, minority_master

pytestmark = [pytest.mark.asyncio, pytest.mark.faults, pytest.mark.timeout(600)]
DURATION_S = 10.0  # past the failover (about two node timeouts of 2 s)


@pytest.mark.parametrize("durability", ["replicated", "async"])
async def test_a_master_in_the_minority_loses_no_step_a_trainer_was_told_with_replicated_durability(
        durability: str) -> None:
    missing = missing_tools()
    if missing:
        pytest.skip(f"the fault tier needs {', '.join(missing)} (scripts/run_fault_tests.sh)")
    outcome = await minority_master(durability, DURATION_S)
    print(f"\n{HEADER}\n{outcome.row()}")
    assert outcome.told > 0, "the trainer was never told a step committed"
    if durability == "replicated":
        assert outcome.lost == 0, outcome
        assert outcome.went_on == SESSIONS, outcome  # each session steps on after the heal
