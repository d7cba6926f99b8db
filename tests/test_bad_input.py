"""Bad input gets a clear error code, changes nothing, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from broker import FleetClient
from broker.ops.replay import list_dead, replay_ids, show
from broker.redis.layouts import log_result_field
from broker.redis.script_replies import Committed, Created, Queued, Refused, Stored
from broker.redis.scripts import CommitCall, Scripts
from schemas.codec import encode
from schemas.errors import ErrorCode, InvalidRequestError
from schemas.limits import LUA_EXACT_STEPS, MAX_STEP_ID, Limits
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


# ---------------------------------------------------------------------- issue #11: the client never raises


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        (np.array([0.0, np.nan] + [0.0] * 6), "finite"),
        (np.zeros(8, dtype=np.complex128), "only numbers"),
        (np.array([object()] * 8, dtype=object), "only numbers"),
        (np.array([0.0, np.inf] + [0.0] * 6, dtype=np.float32), "finite"),
    ],
)
async def test_numpy_state_is_read_as_its_list_or_refused(fleet: FleetClient, workers: WorkerPool,
                                                          state: np.ndarray, needle: str) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **_with(world_step(0), state=state))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and needle in r.error.message
    assert (await s.status()).next_step_id == 0
    ok = await s.step(0, **_with(world_step(0), state=np.zeros(8)))  # a valid float array is its list
    assert ok.ok, ok.error


async def test_numpy_arrays_where_mappings_or_lists_belong_are_refused(fleet: FleetClient,
                                                                      workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    w = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await w.step(0, **_with(world_step(0), images=np.zeros(3)))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST
    t = await fleet.create_session(model="null-lm", mode="tokens")
    for kwargs in ({"token_ids": [1], "sampling": np.zeros(2)}, {"token_ids": [1], "multimodal": np.zeros(2)},
                   {"token_ids": [1], "sampling": {"stop_token_ids": np.array([[1, 2]])}},
                   {"token_ids": np.array([[1, 2]])}, {"token_ids": [1], "sampling": {"max_tokens": 10**400}},
                   {"token_ids": [1], "sampling": {"temperature": 10**400}}):
        r = await t.step(0, **kwargs)
        assert r.error and r.error.code is ErrorCode.INVALID_REQUEST, kwargs
    assert (await t.status()).next_step_id == 0
    r = await w.step(0, **_with(world_step(0), state=[10**400] * 8))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "finite" in r.error.message


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"retention": None}, "retention"),
        ({"retention": "last:abc"}, "retention"),
        ({"retention": "last:-1"}, "retention"),
        ({"retention": "bogus"}, "retention"),
        ({"result_window": "4"}, "result_window"),
        ({"result_window": 10**30}, "result_window"),
        ({"result_window": 2.5}, "result_window"),
        ({"result_window": True}, "result_window"),
        ({"result_window": 0}, "result_window"),
        ({"session_id": "a\nb"}, "session id"),
        ({"session_id": "a\x00b"}, "session id"),
        ({"session_id": "x" * 1_000_000}, "session id"),
        ({"session_id": "a{b}"}, "session id"),
        ({"session_id": 5}, "session id"),
    ],
)
async def test_create_session_refuses_bad_options(fleet: FleetClient, workers: WorkerPool, options: dict,  # type: ignore[type-arg]
                                                  needle: str) -> None:
    await workers.add(NullEngine())
    with pytest.raises(InvalidRequestError, match=needle):
        await fleet.create_session(model="null-world", mode="world_model_env", **options)
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0  # nothing was created


async def test_create_session_accepts_last_n_retention_and_runs_its_steps(fleet: FleetClient,
                                                                         workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env", retention="last:2",
                                   result_window=2, session_id="episode-7.a_b")
    assert (await s.step(0, **world_step(0))).ok
    assert (await s.status()).retention == "last:2"


@pytest.mark.parametrize("step_id", [2**63, 2**64, 10**30, -1, 1.0, True, "3"])
async def test_step_ids_out_of_range_are_refused_before_sending(fleet: FleetClient, workers: WorkerPool,
                                                                step_id: object) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for contextual in (False, True):
        r = await s.step(step_id, use_session_context=contextual, **world_step(0))  # type: ignore[arg-type]
        assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "step_id" in r.error.message
        queued = await s.enqueue(step_id, results_stream="out", use_session_context=contextual,  # type: ignore[arg-type]
                                 **world_step(0))
        assert queued.error and queued.error.code is ErrorCode.INVALID_REQUEST
    assert await fleet.redis.xlen(fleet.keys.dead) == 0
    assert (await s.status()).next_step_id == 0


@pytest.mark.parametrize("step_id", [2**53 + 1, 10**17, MAX_STEP_ID])
async def test_large_stateless_step_ids_come_back_exact(fleet: FleetClient, workers: WorkerPool,
                                                       step_id: int) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(step_id, use_session_context=False, **world_step(0))
    assert r.ok and r.step_id == step_id, r
    assert await fleet.redis.xlen(fleet.keys.dead) == 0


@pytest.mark.parametrize("step_id", [2**53 + 1, 10**17, MAX_STEP_ID])
async def test_a_large_contextual_step_id_is_out_of_order_with_its_exact_text(
        fleet: FleetClient, workers: WorkerPool, step_id: int) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(step_id, **world_step(0))
    assert r.error and r.error.code is ErrorCode.STEP_OUT_OF_ORDER, r
    assert r.error.message == f"Expected step_id 0, got {step_id}."
    assert (await s.status()).next_step_id == 0


async def test_large_contextual_step_ids_keep_exact_log_fields(scripts: Scripts) -> None:
    """Lua prints a number with 14 digits when it joins it to a string: the inbox entry, the log's
    field names and the messages must still carry the exact step id up to LUA_EXACT_STEPS (the
    most a session's counters can reach exactly)."""
    await scripts.register("w1", capacity=4, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    # a window of 3: the result's slot (step mod 3) must be exact too
    assert await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full", result_window=3) == Created("w1")
    for start in (10**15 + 3, LUA_EXACT_STEPS - 1):
        await scripts.redis.hset(scripts.keys.session("s1"),
                                 mapping={"committed_step_id": start - 1, "next_step_id": start})
        for step in (start, start + 1):
            queued = await scripts.enqueue("s1", "w1", step_id=step, contextual=True, job_id=f"j{step}",
                                           reply_to="c", payload=b"p")
            assert isinstance(queued, Queued)
            entry = await scripts.redis.xrange(scripts.keys.inbox("w1"), queued.entry_id, queued.entry_id)
            assert entry[0][1][b"step_id"] == str(step).encode()
            committed = await scripts.commit(CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=step,
                                             entry_id=queued.entry_id, result=f"r{step}".encode(), context_length=3,
                                             job_id=f"j{step}", reply_to="c", reply_ttl_ms=60000,
                                             record=b"in", keep_records=1))
            assert committed == Committed()
        fields = sorted(await scripts.redis.hkeys(scripts.keys.log("s1")))
        assert fields == sorted([log_result_field(start, 3).encode(), log_result_field(start + 1, 3).encode(),
                                 f"input:{start + 1}".encode()])
        again = await scripts.enqueue("s1", "w1", step_id=start, contextual=True, job_id="again", reply_to="c",
                                      payload=b"p")
        assert again == Stored(f"r{start}".encode(), start + 1)
        old = await scripts.enqueue("s1", "w1", step_id=start - 5, contextual=True, job_id="old", reply_to="c",
                                    payload=b"p")
        assert isinstance(old, Refused)
        assert old.message == f"Step {start - 5} is already committed; highest committed step is {start + 1}."
        await scripts.redis.delete(scripts.keys.log("s1"))


async def test_oversized_arrays_are_refused_before_any_byte_is_sent(fleet: FleetClient,
                                                                    workers: WorkerPool) -> None:
    """A 48 MB image is over the element limit: the client refuses it without shipping it."""
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    big = np.zeros((4096, 4096, 3), dtype=np.uint8)  # 48 MiB, 50M elements > 16M
    before = await _bytes_into_redis(fleet)
    r = await s.step(0, **_with(world_step(0), images={"cam": big}))
    assert r.error and r.error.code is ErrorCode.PAYLOAD_TOO_LARGE and "elements" in r.error.message
    step = world_step(0)
    step["action"]["extra"] = {"latent": np.zeros(17 * 1024 * 1024, dtype=np.uint8)}
    r = await s.step(0, **step)
    assert r.error and r.error.code is ErrorCode.PAYLOAD_TOO_LARGE
    step["action"]["extra"] = {"latent": [np.zeros(4, dtype=np.complex64)]}
    r = await s.step(0, **step)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "complex64" in r.error.message
    assert await _bytes_into_redis(fleet) - before < 1024 * 1024
    assert (await s.status()).next_step_id == 0


async def _bytes_into_redis(fleet: FleetClient) -> int:
    stats = await fleet.redis.info("stats")
    return int(stats["total_net_input_bytes"])


async def test_malformed_dead_letters_get_a_clear_line_in_replay(redis_server, prefix: str,  # type: ignore[no-untyped-def]
                                                                 fleet: FleetClient, scripts: Scripts) -> None:
    bad = await fleet.redis.xadd(fleet.keys.dead, {"reason": "inference_error: x", "attempts": "abc",
                                                   "failed_ms": "soon", "kind": "step", "session_id": "s1",
                                                   "step_id": "1e+17", "payload": b"\xff"})
    junk = await fleet.redis.xadd(fleet.keys.dead, {"reason": b"\xff\xfe", "attempts": "-", "min_version": "x"})
    listed = await list_dead(scripts)
    assert [job.entry_id for job in listed] == [bad.decode(), junk.decode()]
    assert all(job.code == "malformed_dead_letter" and not job.replayable for job in listed)
    assert "attempts" in listed[0].reason
    shown = await show(scripts, bad.decode())
    assert shown is not None and shown.code == "malformed_dead_letter"
    outcomes = await replay_ids(scripts, [bad.decode(), junk.decode()])
    assert [o.status for o in outcomes] == ["not_replayable", "not_replayable"]
    assert await fleet.redis.xlen(fleet.keys.dead) == 2  # nothing removed, nothing enqueued
    base = [sys.executable, "-m", "cli.main", "replay", "--redis-url", redis_server.url, "--prefix", prefix]
    for args in (["list"], ["list", "--json"], ["show", bad.decode()], ["run"], ["run", bad.decode()]):
        out = await asyncio.to_thread(subprocess.run, [*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr)
        assert "malformed_dead_letter" in out.stdout or "not_replayable" in out.stdout, (args, out.stdout)
