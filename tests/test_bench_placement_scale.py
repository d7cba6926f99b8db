"""bench.placement_scale measures this checkout beside a worktree of a revision, one pool size per
child process. Benchmarks are not tests: no speed is asserted."""

from __future__ import annotations

import subprocess

import pytest

from bench import placement_scale
from bench.common import REPO


@pytest.mark.timeout(300)
def test_both_checkouts_create_and_hand_over_at_every_pool_size() -> None:
    rows = placement_scale.run("smoke", "HEAD")
    sizes = placement_scale.SIZE["smoke"].pools
    assert [(row.case.split()[2], row.system) for row in rows] == [
        (str(n), system) for n in sizes for system in ("fleet @ this checkout", "fleet @ HEAD", "this checkout / HEAD")]
    for row in rows:
        if row.system.startswith("fleet @"):  # every session moved (the child checks), every figure measured
            assert row.values["create_us"] > 0 and row.values["handover_ms"] > 0, row
    here = [row.values for row in rows if row.system == "fleet @ this checkout"]
    # This checkout's commands do not grow with the pool: a count, not a speed.
    assert len({values["create_commands"] for values in here}) == 1
    assert len({values["handover_commands"] for values in here}) == 1
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True,
                               check=True).stdout
    assert "bench-rev-" not in worktrees  # the temporary checkout is gone


def test_a_revision_that_does_not_exist_is_one_line() -> None:
    with pytest.raises(SystemExit) as exc:
        placement_scale.run("smoke", "no-such-revision")
    assert "cannot check out 'no-such-revision'" in str(exc.value)
