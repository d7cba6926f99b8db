"""The gateway point by point against the vLLM-Omni serving layer, as a rollout client sees it:
the session's own values in every answer, the serving layer's wording, its model check, its empty
observation and action, and ``--upstream-errors``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest

from broker import FleetClient
from broker.gateway.settings import GatewaySettings
from broker.redis.embedded import RedisServer
from schemas.codec import decode
from schemas.messages import Mode, StepResult, WorldStep
from tests.support import WorkerPool, image
from tests.test_gateway import SESSIONS, GatewayServer, body, create, http, step_error
from tests.test_multiturn import reference_engine
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine
from workers.engines.vllm_omni_engine import robot_obs

__all__ = ["http"]  # the fixture, shared with tests/test_gateway.py

DREAMZERO_MODEL = "DreamZero-DROID"


class DreamZeroNamedEngine(NullEngine):
    """The null engine under a DreamZero checkpoint's name, for the serving layer's model check."""

    def models(self) -> Mapping[str, Mode]:
        return {DREAMZERO_MODEL: Mode.WORLD_MODEL_ENV}


@pytest.fixture
async def upstream_http(redis_server: RedisServer, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    async with GatewayServer(redis_server.url, prefix, settings=GatewaySettings(upstream_errors=True)) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
        yield client


async def stepped(http: httpx.AsyncClient, sid: str, steps: int) -> None:
    for i in range(steps):
        r = await http.post(f"{SESSIONS}/{sid}/step", json=body(i))
        assert r.status_code == 200 and r.json()["error"] is None, r.text


async def test_a_refusal_before_redis_reports_the_sessions_values(http: httpx.AsyncClient,
                                                                  workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    await stepped(http, sid, 2)
    bad = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(2, images={"cam": "not base64!"})),
                     400, "invalid_request")
    assert bad["model_metadata"]["committed_step_id"] == 1 and bad["model_metadata"]["context_length"] == 2
    assert bad["error"]["committed_step_id"] == 1
    two_joints = body(2)
    two_joints["action"]["joint_positions"] = [0.1, 0.2]  # refused by the fleet's step schema, in the client
    bad = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=two_joints), 400, "invalid_request")
    assert bad["model_metadata"]["committed_step_id"] == 1 and bad["model_metadata"]["context_length"] == 2
    assert bad["error"]["committed_step_id"] == 1


async def test_a_stateless_step_reports_the_sessions_context_length(http: httpx.AsyncClient,
                                                                     workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    await stepped(http, sid, 3)
    r = await http.post(f"{SESSIONS}/{sid}/step", json=body(50, use_session_context=False))
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert r.json()["model_metadata"]["context_length"] == 3
    assert r.json()["model_metadata"]["committed_step_id"] == 2


async def test_errors_keep_the_serving_layers_wording(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    await stepped(http, sid, 1)
    gap = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(5)), 400, "step_out_of_order")
    assert gap["error"]["message"] == "Expected step_id 1, got 5."


async def test_model_is_required_and_dreamzero_matches_case_insensitively(
        redis_server: RedisServer, prefix: str, workers: WorkerPool) -> None:
    await workers.add(DreamZeroNamedEngine())
    async with GatewayServer(redis_server.url, prefix, model_default=DREAMZERO_MODEL) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        missing = await http.post(SESSIONS, json={"mode": "world_model_env"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.model"
        for name in ("dreamzero", "DreamZero", DREAMZERO_MODEL):
            r = await http.post(SESSIONS, json={"model": name, "mode": "world_model_env"})
            assert r.status_code == 200, (name, r.text)
        assert (await http.post(SESSIONS, json={"model": "other"})).status_code == 400


async def test_an_empty_observation_and_action_are_accepted(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    sid = await create(http, model="null-world")
    r = await http.post(f"{SESSIONS}/{sid}/step", json={"step_id": 0, "observation": {}, "action": {}})
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    state_only = {"step_id": 1, "observation": {"state": [0.1] * 8}, "action": {}}
    assert (await http.post(f"{SESSIONS}/{sid}/step", json=state_only)).json()["error"] is None


async def test_upstream_errors_refuse_a_resent_committed_step(upstream_http: httpx.AsyncClient,
                                                              workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(upstream_http)
    await stepped(upstream_http, sid, 3)
    again = await upstream_http.post(f"{SESSIONS}/{sid}/step", json=body(1))
    data: dict[str, Any] = step_error(again, 400, "step_already_committed")
    assert "x-rollout-duplicate" not in again.headers
    assert data["error"]["message"] == "Step 1 is already committed; highest committed step is 2."
    assert data["model_metadata"]["committed_step_id"] == 2 and data["model_metadata"]["context_length"] == 3


async def test_a_closed_session_stays_answerable_for_the_closed_retention(
        http: httpx.AsyncClient, fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine(), closed_retention_hours=2.0)
    sid = await create(http)
    await stepped(http, sid, 1)
    assert (await http.post(f"{SESSIONS}/{sid}/close")).json() == {"session_id": sid, "closed": True}
    keys = fleet.keys_of(sid)
    # The hash outlives the results' grace TTL: hours, not the 60 s it had (no clock is waited on).
    assert 3_600_000 < await fleet.redis.pttl(keys.session(sid)) <= 7_200_000
    assert await fleet.redis.pttl(keys.log(sid)) <= 60_000
    status = await http.get(f"{SESSIONS}/{sid}/status")
    assert status.status_code == 200 and status.json()["closed"] is True
    assert (await http.post(f"{SESSIONS}/{sid}/close")).json() == {"session_id": sid, "closed": True}
    closed = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(1)), 410, "session_closed")
    # As the serving layer answers a step of a session it cannot step: -1 and 0, not the last values.
    assert closed["model_metadata"]["committed_step_id"] == -1 and closed["model_metadata"]["context_length"] == 0
    assert closed["error"]["committed_step_id"] == -1


async def test_float_images_are_accepted_as_upstream_takes_them(http: httpx.AsyncClient,
                                                                 workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    pixels = image(7)
    normalized, as_floats = (pixels / 255.0).tolist(), pixels.astype(float).tolist()
    answers = []
    for step, images in enumerate(({"cam": pixels.tolist()}, {"cam": normalized}, {"cam": as_floats})):
        r = await http.post(f"{SESSIONS}/{sid}/step", json=body(0, images=images, use_session_context=False) |
                            {"step_id": step})
        assert r.status_code == 200 and r.json()["error"] is None, r.text
        answers.append(r.json()["next_observation"])
    assert answers[0] == answers[1] == answers[2]  # the same picture, whichever way it was sent


class RecordingEngine(NullEngine):
    """The null engine, keeping each world step it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[WorldStep] = []

    def _one(self, req: EngineRequest) -> EngineOutput | BaseException:
        if isinstance(req.step, WorldStep):
            self.steps.append(req.step)
        return super()._one(req)


async def test_extra_fields_reach_the_engines_robot_observation_verbatim(http: httpx.AsyncClient,
                                                                          workers: WorkerPool) -> None:
    engine = RecordingEngine()
    await workers.add(engine)
    sid = await create(http, model="null-world")
    extra = {"observation/wrist_image_left": [[1, 2], [3, 4]], "seed": 3, "embodiment_name": "droid",
             "note": {"a": [1, 2.5]}}
    step = {"step_id": 0, "observation": {"extra": extra}, "action": {"extra": {"k": "v"}}}
    assert (await http.post(f"{SESSIONS}/{sid}/step", json=step)).json()["error"] is None
    seen = engine.steps[-1]
    assert dict(seen.observation.extra) == extra and seen.action and dict(seen.action.extra) == {"k": "v"}
    obs = robot_obs(seen)
    assert obs["observation/wrist_image_left"] == extra["observation/wrist_image_left"]
    assert obs["seed"] == 3 and obs["embodiment_name"] == "droid" and "note" not in obs  # upstream's filter


async def test_no_state_invents_no_zeros_and_an_8_value_state_is_joints_and_gripper(
        http: httpx.AsyncClient, workers: WorkerPool) -> None:
    """Upstream's DROID mapping: with no action values, ``state[:7]`` are the joints and
    ``state[7:8]`` the gripper; with neither, the keys are left out (no zeros stand in)."""
    engine = RecordingEngine()
    await workers.add(engine)
    sid = await create(http, model="null-world")
    steps = [{"observation": {}, "action": {}},
             {"observation": {"state": [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 0.75]}, "action": {}},
             {"observation": {"state": [0.5] * 7}, "action": {"gripper_position": 0.25}}]
    for step_id, step in enumerate(steps):
        r = await http.post(f"{SESSIONS}/{sid}/step", json={"step_id": step_id, **step})
        assert r.status_code == 200 and r.json()["error"] is None, r.text
    empty, eight, seven = (robot_obs(step) for step in engine.steps)
    assert "observation/joint_position" not in empty and "observation/gripper_position" not in empty
    assert engine.steps[0].observation.state == () and engine.steps[0].given_robot_state() == (None, None)
    assert eight["observation/joint_position"].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    assert eight["observation/gripper_position"].tolist() == [0.75]
    assert seven["observation/joint_position"].tolist() == [0.5] * 7
    assert seven["observation/gripper_position"].tolist() == [0.25]


async def test_a_refused_input_is_answered_in_the_serving_layers_order_of_checks(
        http: httpx.AsyncClient, workers: WorkerPool) -> None:
    """The serving layer checks the session, then the step id, then the input: a bad input with a
    wrong step id (or on a closed session) is refused for the id (or the session), as there."""
    await workers.add(reference_engine())
    sid = await create(http)
    await stepped(http, sid, 1)

    def bad(step_id: int) -> dict[str, Any]:
        return body(step_id, images={"cam": "not base64!"})

    ahead = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=bad(7)), 400, "step_out_of_order")
    assert ahead["error"]["message"] == "Expected step_id 1, got 7."
    assert ahead["model_metadata"]["committed_step_id"] == 0 and ahead["model_metadata"]["context_length"] == 1
    behind = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=bad(0)), 400, "step_already_committed")
    assert behind["error"]["message"] == "Step 0 is already committed; highest committed step is 0."
    huge = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(2**64)), 400, "step_out_of_order")
    assert huge["step_id"] == 2**64 and huge["error"]["message"] == f"Expected step_id 1, got {2**64}."
    packed = await http.post(f"{SESSIONS}/{sid}/step", json=body(2**64), headers={"Accept": "application/msgpack"})
    assert packed.status_code == 400 and StepResult.from_wire(decode(packed.content)).step_id == -1
    step_error(await http.post(f"{SESSIONS}/{sid}/step", json=bad(1)), 400, "invalid_request")
    stateless = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=bad(0) | {"use_session_context": False}),
                           400, "invalid_request")
    assert stateless["model_metadata"]["committed_step_id"] == 0
    await http.post(f"{SESSIONS}/{sid}/close")
    closed = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=bad(1)), 410, "session_closed")
    assert closed["model_metadata"]["committed_step_id"] == -1
