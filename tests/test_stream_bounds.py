"""The dead-letter stream and the reply streams are bounded in bytes, whatever the payloads and
results weigh; measured with ``MEMORY USAGE`` after an abusive sequence."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.ops.replay import list_dead, replay
from broker.redis.layouts import DEAD_LETTER_PAYLOAD_BYTES, dead_letter_payload
from broker.redis.script_replies import Queued, Retired
from broker.redis.scripts import Scripts
from schemas.codec import encode
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine, NullEngineConfig

pytestmark = pytest.mark.asyncio
MB = 1024 * 1024


def heavy_failing_step(i: int) -> dict[str, Any]:
    """A world step of about 2 MB (one 820x850 image) that the null engine fails."""
    step = world_step(i, prompt="fail")
    step["observation"]["images"] = {"cam": np.full((820, 850, 3), i % 256, dtype=np.uint8)}
    return step


async def memory(fleet: FleetClient, key: str) -> int:
    return int(await fleet.redis.memory_usage(key, samples=0) or 0)


async def test_dead_letters_keep_large_payloads_only_as_a_marker(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), max_attempts=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for _ in range(20):  # the same step fails 20 times; each failure is dead-lettered
        r = await s.step(0, **heavy_failing_step(0))
        assert r.error and r.error.code.value == "inference_error"
    assert await fleet.redis.xlen(fleet.keys.dead) == 20
    used = await memory(fleet, fleet.keys.dead)
    assert used < 20 * (DEAD_LETTER_PAYLOAD_BYTES + 4096), f"{used / MB:.1f} MB for 20 letters"
    letters = await list_dead(fleet.scripts)
    assert all(not letter.replayable and letter.payload == b"" for letter in letters)
    assert "too large" in letters[0].payload_dropped and str(DEAD_LETTER_PAYLOAD_BYTES) in letters[0].payload_dropped
    [outcome] = await replay(fleet.scripts, letters[:1])
    assert outcome.status == "not_replayable" and "too large" in outcome.message


async def test_a_small_payload_is_still_kept_and_replayable(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), max_attempts=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0, prompt="fail"))).error
    [letter] = await list_dead(fleet.scripts)
    assert letter.replayable and letter.payload and not letter.payload_dropped


async def test_a_vanished_clients_reply_stream_stays_under_its_byte_budget(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    """Results of 2 MB each for a reply stream nobody reads any more."""
    budget = 8 * MB
    w = await workers.add(NullEngine(NullEngineConfig(latent_shape=(1, 512 * 1024))), reply_stream_bytes=budget,
                          large_reply_ttl_ms=60_000)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(20):
        reply = await fleet.scripts.enqueue(s.session_id, w.id, step_id=i, contextual=True, job_id=f"j{i}",
                                            reply_to="vanished", payload=encode(world_step(i)))
        assert isinstance(reply, Queued)
    stream = fleet.keys.reply("vanished")
    for _ in range(100):
        if (await s.status()).committed_step_id == 19:
            break
        await asyncio.sleep(0.05)
    assert (await s.status()).committed_step_id == 19
    used = await memory(fleet, stream)
    assert used <= budget + 3 * MB, f"{used / MB:.1f} MB kept for a reader that left"
    assert 0 < await fleet.redis.pttl(stream) <= 60_000  # large results: the shorter TTL


async def test_retire_keeps_an_orphans_large_payload_only_as_a_marker(scripts: Scripts) -> None:
    await scripts.register("w1", capacity=2, pools=[], ttl_ms=15000, fields={"state": "active"})
    big = b"x" * (2 * MB)
    for i in range(5):  # entries of sessions that no longer exist
        await scripts.redis.xadd(scripts.keys.inbox("w1"), {"kind": "step", "session_id": f"gone{i}", "step_id": 0,
                                                             "payload": big})
    assert await scripts.retire("w1", pools=[], lease_ms=5000, reason="drained") == Retired(5)
    used = int(await scripts.redis.memory_usage(scripts.keys.dead, samples=0) or 0)
    assert used < 5 * 4096, f"{used} bytes for 5 orphans"
    letters = await list_dead(scripts)
    assert len(letters) == 5 and all(not letter.replayable for letter in letters)
    assert letters[0].payload_dropped == (f"payload too large to keep: {2 * MB} bytes, over the dead-letter budget "
                                          f"of {DEAD_LETTER_PAYLOAD_BYTES} bytes")
    assert letters[0].payload_dropped == dead_letter_payload(big)[1]  # Lua and Python say the same
