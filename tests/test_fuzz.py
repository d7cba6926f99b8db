"""Fuzzing the front doors: the codec, the step parsers and a live worker's inbox.

Each bad input must end as a clear error (InvalidRequestError or PayloadTooLargeError; a
dead letter or an answer with its code), never a crash, never a stuck session. CI runs a small
number of examples; ``ROLLOUT_FLEET_FUZZ_EXAMPLES=20000`` runs the long variant by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import FleetClient
from schemas.codec import decode, encode
from schemas.errors import ErrorCode, InvalidRequestError, PayloadTooLargeError
from schemas.limits import Limits
from schemas.messages import Mode, parse_step_input
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

EXAMPLES = int(os.environ.get("ROLLOUT_FLEET_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The long variant's map fuzz alone takes minutes (20,000 examples: ~6 min on 2 busy cores), past the
# suite's 300 s per test: the bound grows with the count asked for.
pytestmark = pytest.mark.timeout(300 + EXAMPLES // 20)
SMALL = Limits(max_payload_bytes=1 << 20, max_array_elements=1 << 12, max_container_len=1 << 12)
CLEAR = (InvalidRequestError, PayloadTooLargeError)

_arrays = st.sampled_from(["uint8", "float32", "float64", "int64", "complex64", "bool"]).flatmap(
    lambda dtype: st.lists(st.integers(0, 5), min_size=0, max_size=3).map(
        lambda shape: np.zeros(shape, dtype=dtype)))
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
            | st.binary(max_size=8) | _arrays)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=8)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_names = st.sampled_from(["observation", "action", "prompt", "images", "state", "extra", "joint_positions",
                          "gripper_position", "token_ids", "sampling", "max_tokens", "temperature", "top_p",
                          "top_k", "seed", "stop_token_ids", "return_routed_experts", "multimodal", "cam"])
_messages = st.recursive(st.dictionaries(_names, _values, max_size=5),
                         lambda inner: st.dictionaries(_names, inner | _values, max_size=5), max_leaves=12)


def _valid_payload() -> bytes:
    return encode(parse_step_input(Mode.WORLD_MODEL_ENV, world_step(1)).to_wire())


@FUZZ
@given(st.binary(max_size=512))
def test_decode_of_arbitrary_bytes_fails_clearly(data: bytes) -> None:
    with contextlib.suppress(CLEAR):
        decode(data, SMALL)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 64))
def test_decode_of_mutated_valid_payloads_fails_clearly(flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(_valid_payload())
    for position, value in flips:
        data[position % len(data)] = value
    del data[len(data) - cut:]
    try:
        decoded = decode(bytes(data), SMALL)
        for mode in Mode:
            parse_step_input(mode, decoded, SMALL)
    except CLEAR:
        pass


@FUZZ
@given(_messages)
def test_parse_step_input_of_arbitrary_maps_fails_clearly(data: dict[str, Any]) -> None:
    for mode in Mode:
        try:
            step = parse_step_input(mode, data, SMALL)
            decode(encode(step.to_wire(), SMALL), SMALL)  # what parses also travels
        except CLEAR:
            pass


# ---------------------------------------------------------------------- a live worker's inbox

# Every field is fuzzed, session_id and epoch included: an entry for no session or a foreign epoch
# is acked and dropped like any other the worker cannot run (workers/job_scripts.py, FencedEntries).
_FIELDS = ("kind", "job_id", "session_id", "epoch", "step_id", "contextual", "gen", "mode", "model",
           "reply_to", "enqueued_ms", "attempt", "retention", "min_version", "payload")


def _hostile(rng: random.Random) -> bytes:
    choices: list[bytes] = [b"", b"\xff\xfe", b"-1", b"1e+17", str(2**64).encode(), str(2**53 + 1).encode(),
                            b"step", b"reset", b"close", b"tokens", b"world_model_env", b"last:abc", b"0", b"1",
                            b"x" * rng.randint(1, 5000), rng.randbytes(rng.randint(1, 64)),
                            msgpack.packb({"observation": {"state": [1e308] * 9}}), b"9" * 5000]
    return rng.choice(choices)


def _mutated_entry(rng: random.Random, valid: dict[str, bytes], job_id: str) -> dict[str, bytes]:
    entry = dict(valid, job_id=job_id.encode())
    for name in rng.sample(_FIELDS, rng.randint(1, 4)):
        if rng.random() < 0.25:
            entry.pop(name, None)
        else:
            entry[name] = _hostile(rng)
    if rng.random() < 0.1:
        entry[f"extra-{rng.randint(0, 9)}"] = _hostile(rng)
    return entry


@pytest.mark.asyncio
async def test_random_inbox_entries_never_stop_the_worker(fleet: FleetClient, workers: WorkerPool) -> None:
    # A fuzzed min_version names a policy version nobody announces: such a step waits at the weight
    # gate for version_wait_s (300 s by default) and then answers timeout. A short wait keeps the
    # drain bound below about what the entries cost, however many of them draw such a version.
    w = await workers.add(NullEngine(), version_wait_s=1.0)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    valid = {"kind": b"step", "session_id": s.session_id.encode(), "step_id": b"1", "contextual": b"1",
             "epoch": b"1", "gen": b"0", "mode": b"world_model_env", "model": b"null-world",
             "reply_to": fleet.client_id.encode(), "enqueued_ms": b"0", "attempt": b"0", "retention": b"full",
             "min_version": b"0", "payload": _valid_payload()}
    rng = random.Random(11)
    count = max(20, EXAMPLES // 4)
    for i in range(count):
        await fleet.redis.xadd(fleet.keys.inbox(w.id), _mutated_entry(rng, valid, f"fuzz-{i}"))
    await _drained(fleet, w.id, timeout=30 + count / 50)
    assert not w.task.done(), "the worker stopped"
    for _, fields in await fleet.redis.xrange(fleet.keys.dead):
        code = fields[b"reason"].split(b":", 1)[0].decode()
        assert code in {c.value for c in ErrorCode}, fields[b"reason"][:200]
    fresh = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await asyncio.wait_for(fresh.step(0, **world_step(0)), 10)).ok  # still serving
    st_ = await s.status()
    r = await asyncio.wait_for(s.step(st_.next_step_id, **world_step(st_.next_step_id)), 10)
    assert r.ok or (r.error and r.error.code is not ErrorCode.TIMEOUT), r  # the fuzzed session is not stuck


async def _drained(fleet: FleetClient, worker_id: str, *, timeout: float) -> None:
    """Every fuzzed entry was handled: nothing left in the inbox, nothing pending."""
    deadline = asyncio.get_running_loop().time() + timeout
    inbox = fleet.keys.inbox(worker_id)
    while asyncio.get_running_loop().time() < deadline:
        pending = await fleet.redis.xpending(inbox, "workers")
        if await fleet.redis.xlen(inbox) == 0 and pending["pending"] == 0:
            return
        await asyncio.sleep(0.05)
    left = [{k: v[:40] for k, v in fields.items() if k != b"payload"} for _, fields in await fleet.redis.xrange(inbox)]
    pytest.fail(f"inbox not drained within {timeout:.0f}s: {len(left)} entries left: {left}")


@pytest.mark.asyncio
@pytest.mark.parametrize("changes", [{"session_id": "no-such-session"}, {"epoch": "-1"}])
async def test_an_entry_the_worker_cannot_run_does_not_stay_in_the_inbox(
        fleet: FleetClient, workers: WorkerPool, changes: dict[str, str]) -> None:
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    await fleet.redis.xadd(fleet.keys.inbox(w.id), {
        "kind": "step", "job_id": "ghost-1", "session_id": s.session_id, "step_id": "0", "contextual": "1",
        "epoch": "1", "gen": "0", "mode": "world_model_env", "model": "null-world", "reply_to": fleet.client_id,
        "enqueued_ms": "0", "attempt": "0", "retention": "full", "min_version": "0", "payload": _valid_payload(),
        **changes})
    await _drained(fleet, w.id, timeout=5)
