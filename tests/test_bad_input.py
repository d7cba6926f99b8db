"""Bad input gets a clear error code, changes nothing, and the worker keeps serving."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from broker import FleetClient
from broker.redis.script_replies import Queued
from schemas.codec import encode
from schemas.errors import ErrorCode
from schemas.limits import Limits
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


def _with(step: dict, **changes: object) -> dict:  # type: ignore[type-arg]
    obs = dict(step["observation"])
    act = dict(step["action"])
    for key, value in changes.items():
        target = act if key in ("joint_positions", "gripper_position") else obs
        target[key] = value
    return {"observation": obs, "action": act}


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"joint_positions": [0.0] * 6}, "must have 7 values"),
        ({"gripper_position": [0.0, 1.0]}, "must have 1 values"),
        ({"images": {"cam": np.zeros((8, 8, 3), dtype=np.float32)}}, "must be uint8"),
        ({"images": {"cam": np.zeros((8, 8), dtype=np.uint8)}}, "HxWx3"),
        ({"images": {"cam": [[1, 2, 3]]}}, "uint8 ndarray"),
        ({"state": ["a"]}, "only numbers"),
        ({"prompt": 5}, "prompt must be a string"),
    ],
)
async def test_client_rejects_bad_world_input(fleet: FleetClient, workers: WorkerPool, changes: dict,  # type: ignore[type-arg]
                                              needle: str) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **_with(world_step(0), **changes))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and needle in r.error.message
    assert (await s.status()).next_step_id == 0  # nothing was enqueued
    assert (await s.step(0, **world_step(0))).ok


async def test_wrong_mode_arguments_and_bad_tokens(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    t = await fleet.create_session(model="null-lm", mode="tokens")
    for kwargs in ({"observation": {"prompt": "x"}}, {"token_ids": [1, -2]}, {"token_ids": "abc"},
                   {"token_ids": [1], "sampling": {"temperature": -1}},
                   {"token_ids": [1], "sampling": {"max_tokens": 1.5}},
                   {"token_ids": [1], "sampling": {"bogus": 1}}):
        r = await t.step(0, **kwargs)
        assert r.error and r.error.code is ErrorCode.INVALID_REQUEST, kwargs
    r = await t.step(-1, token_ids=[1])
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST
    assert (await t.step(0, token_ids=[1, 2])).ok


async def test_oversized_payload(redis_server, prefix: str, workers: WorkerPool) -> None:  # type: ignore[no-untyped-def]
    await workers.add(NullEngine())
    async with FleetClient(redis_server.url, prefix=prefix, limits=Limits(max_payload_bytes=10_000)) as fleet:
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        big = np.zeros((100, 100, 3), dtype=np.uint8)
        r = await s.step(0, **_with(world_step(0), images={"cam": big}))
        assert r.error and r.error.code is ErrorCode.PAYLOAD_TOO_LARGE
        assert (await s.status()).next_step_id == 0


async def _raw_enqueue(fleet: FleetClient, s, step_id: int, payload: bytes):  # type: ignore[no-untyped-def]
    """Bypass client validation: what a buggy or hostile producer could push."""
    waiter_id = f"raw-{step_id}-{len(payload)}"
    fut = fleet.replies.expect(waiter_id)
    reply = await fleet.scripts.enqueue(s.session_id, s.owner, step_id=step_id, contextual=True, job_id=waiter_id,
                                        reply_to=fleet.client_id, payload=payload)
    assert isinstance(reply, Queued)
    return fleet.decode_result(await fut, 0.0)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1\xc1garbage",
        msgpack.packb({"observation": {"prompt": "x"}, "action": {"joint_positions": [1.0] * 3}}),
        encode({"observation": {"images": {"cam": np.zeros((4, 4, 3), dtype=np.int64)}}}),
        msgpack.packb([1, 2, 3]),
    ],
)
async def test_worker_rejects_malformed_payloads_and_keeps_serving(
    fleet: FleetClient, workers: WorkerPool, payload: bytes
) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    r = await _raw_enqueue(fleet, s, 1, payload)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and r.committed_step_id == 0
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id) == (0, 1)  # the same step_id can be sent again
    r = await s.step(1, **world_step(1))
    assert r.ok and r.output["context"] == 1


async def test_malformed_inbox_entry_is_dead_lettered_and_answered(fleet: FleetClient, workers: WorkerPool) -> None:
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    fut = fleet.replies.expect("junk-1")
    await fleet.redis.xadd(fleet.keys.inbox(w.id), {"kind": "step", "job_id": "junk-1", "session_id": s.session_id,
                                                     "reply_to": fleet.client_id, "step_id": "zero"})
    r = fleet.decode_result(await fut, 0.0)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "malformed job" in r.error.message
    dead = await fleet.redis.xrange(fleet.keys.dead)
    assert len(dead) == 1 and dead[0][1][b"reason"].startswith(b"invalid_request")
    assert (await s.step(0, **world_step(0))).ok  # still serving
    assert await fleet.redis.xlen(fleet.keys.inbox(w.id)) == 0  # nothing left behind
