"""The real-engine benchmarks at smoke size (bench/real_tokens.py, bench/real_world.py): they run
end to end against the real servers and engines, and every system gives the direct path's tokens and
latents. No timing is checked here: docs/benchmarks.md has the numbers and the command."""

from __future__ import annotations

import pytest

from bench import real_tokens, real_world
from tests.engines.conftest import requires_vllm, requires_vllm_omni

pytestmark = pytest.mark.engines


@requires_vllm
@pytest.mark.timeout(1800)  # two vLLM starts (a server, then the in-process engine): minutes each on 2 loaded CPUs
async def test_token_rollouts_run_and_every_system_gives_the_direct_tokens() -> None:
    size = real_tokens.SIZES["smoke"]
    rows, bad = await real_tokens.measure(size)
    assert bad == []
    systems = {row.system: row.values for row in rows}
    generated = size.rounds * size.sessions * size.turns
    for name in ("direct /inference/v1/generate", "fleet vllm-http", f"fleet vllm-http, {size.sessions} workers",
                 "fleet vllm (in process)"):
        assert systems[name]["tokens"] >= generated, (name, systems[name])  # at least one token a turn
    assert systems["fleet vllm-http"]["batches"] > 0 and systems["fleet vllm (in process)"]["batches"] > 0


@requires_vllm_omni
@pytest.mark.timeout(900)
async def test_world_steps_run_and_every_system_gives_the_direct_latents() -> None:
    size = real_world.SIZES["smoke"]
    rows, bad = await real_world.measure(size)
    assert bad == []
    steps = float(size.rounds * size.episodes * size.steps)
    for row in rows[:4]:
        assert row.values["steps"] == steps, row
    assert all(row.values["batches"] > 0 for row in rows[1:4])


def test_mismatches_name_the_turn_that_differs() -> None:
    ok = real_tokens.Run(tokens=[[[5, 6], [7]]], turn_ms=[1.0, 1.0], wall_s=1.0)
    other = real_tokens.Run(tokens=[[[5, 6], [8]]], turn_ms=[1.0, 1.0], wall_s=1.0)
    assert real_tokens.mismatches([ok], [ok], "x") == []
    assert real_tokens.mismatches([ok], [other], "x") == ["x: round 0 conversation 0 turn 1: direct [7] != [8]"]
    latents = real_world.Run(latents=[[b"a", b"b"]], step_ms=[1.0], wall_s=1.0)
    changed = real_world.Run(latents=[[b"a", b"c"]], step_ms=[1.0], wall_s=1.0)
    assert real_world.mismatches([latents], [changed], "y") == ["y: round 0 episode 0 step 1: latent differs "
                                                                "from the direct path"]
