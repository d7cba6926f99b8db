"""Conformance of the gateway with vLLM-Omni's own rollout server, as a client sees them.

One request script (create, good and bad steps, a re-sent step, a stateless step, status, reset,
close twice, status after close, an unknown session, malformed bodies) runs against vLLM-Omni's
rollout API served around the CPU stand-in engine (``omni_server``: its router, serving objects and
vLLM's exception handlers) and against the gateway with ``upstream_errors`` (``--upstream-errors``)
over a fleet whose worker runs the same stand-in through the vLLM-Omni engine (in process, or over
HTTP against that same server). For each call the two answers must have the same status and the
same JSON shape (key sets and value types, recursively), and the values a client acts on must be
equal: committed step, context length, error codes, statuses, latent shape and dtype, and the
latent itself where both ran the same inputs.

A call where the two still differ names the difference and its reason (``Call.differs``); the
test then checks that they do differ, so the note cannot outlive the behaviour. The same
differences are listed in the README's gateway section.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from broker.gateway.settings import GatewaySettings
from broker.redis.embedded import RedisServer
from tests.engines.conftest import OMNI_MODEL, Service, requires_vllm_omni
from tests.engines.test_vllm_omni_engines import http_engine, inproc_engine
from tests.support import WorkerPool, image
from tests.test_gateway import SESSIONS, GatewayServer

pytestmark = [pytest.mark.engines, requires_vllm_omni]

UNKNOWN = "0123456789abcdef0123456789abcdef"  # a well-formed id no session has

# Values a client acts on: equal on both sides wherever the path exists in the answer.
EQUAL = ("mode", "step_id", "committed_step_id", "context_length", "closed",
         "model_metadata.committed_step_id", "model_metadata.context_length", "model_metadata.steps_generated",
         "next_observation.shape", "next_observation.dtype", "next_observation.encoding",
         "error.code", "error.step_id", "error.committed_step_id", "error.type", "error.param")
LATENT = "next_observation.video_latent"


def step(step_id: int, *, joints: Sequence[float] | None = None, image_seed: int | None = None,
         scale: float | None = None, **extra: Any) -> dict[str, Any]:
    """A DROID-style step body: one camera image as nested lists (as floats, times ``scale``, if
    given), a 7+1 action, an explicit seed."""
    pixels = image(image_seed if image_seed is not None else step_id, 12, 16)
    return {"step_id": step_id,
            "observation": {"prompt": "pick the cup",
                            "images": {"observation/exterior_image_1_left":
                                       pixels.tolist() if scale is None else (pixels * scale).tolist()},
                            "state": [0.02 * step_id] * 8, "extra": {"seed": 1000 + step_id}},
            "action": {"joint_positions": list(joints) if joints is not None else [0.1 * j for j in range(7)],
                       "gripper_position": 0.25},
            **extra}


def seeded(body: dict[str, Any], seed: int) -> dict[str, Any]:
    """``body`` with another sampling seed (a step's default one grows with its id)."""
    body["observation"]["extra"]["seed"] = seed
    return body


@dataclass(frozen=True)
class Call:
    name: str
    method: str
    path: str  # under /v1/realtime/sessions; {sid} is the session the script created
    body: Any = None
    raw: bytes | None = None  # a body sent as is (not JSON-encoded)
    same_latent: bool = False  # both sides ran the same inputs on the same context
    same_message: bool = False  # the wording is part of the contract
    differs: str = ""  # a documented difference: why the gateway answers otherwise
    then: Mapping[str, Any] = field(default_factory=dict)  # expected values on both sides


SCRIPT: tuple[Call, ...] = (
    Call("create", "POST", "", {"model": OMNI_MODEL, "mode": "world_model_env"}, then={"mode": "world_model_env"}),
    Call("create: another model", "POST", "", {"model": "not-served"}),
    Call("create: no model", "POST", "", {"mode": "world_model_env"}, then={"error.param": "body.model"}),
    Call("create: token mode", "POST", "", {"model": OMNI_MODEL, "mode": "tokens"}),
    Call("step 0", "POST", "{sid}/step", step(0), same_latent=True, then={"model_metadata.committed_step_id": 0}),
    Call("step 0 again", "POST", "{sid}/step", step(0), same_message=True,
         then={"error.code": "step_already_committed", "model_metadata.context_length": 1}),
    Call("step 5: out of order", "POST", "{sid}/step", step(5), same_message=True,
         then={"error.code": "step_out_of_order"}),
    Call("step 1: two joints", "POST", "{sid}/step", step(1, joints=[0.1, 0.2]),
         then={"error.code": "invalid_request", "model_metadata.committed_step_id": 0}),
    Call("step 7: out of order and two joints", "POST", "{sid}/step", step(7, joints=[0.1]), same_message=True,
         then={"error.code": "step_out_of_order"}),
    Call("step 0: committed and two joints", "POST", "{sid}/step", step(0, joints=[0.1]), same_message=True,
         then={"error.code": "step_already_committed"}),
    Call("step 2**64", "POST", "{sid}/step", step(2**64), same_message=True,
         then={"error.code": "step_out_of_order"}),
    Call("step 1: float pixels", "POST", "{sid}/step", step(1, scale=1.0), same_latent=True,
         then={"model_metadata.context_length": 2}),
    Call("stateless step", "POST", "{sid}/step", step(99, image_seed=7, use_session_context=False),
         same_latent=True, then={"model_metadata.context_length": 2, "model_metadata.committed_step_id": 1}),
    Call("stateless: normalized float pixels", "POST", "{sid}/step",
         step(98, image_seed=7, scale=1 / 255, use_session_context=False), same_latent=True,
         differs="floats all within [0, 1] are normalized intensities at the gateway (x255, rounded to the "
                 "fleet's uint8); upstream hands the floats to the model (the stand-in truncates them)"),
    Call("stateless: an image of shape 1x3", "POST", "{sid}/step",
         {**step(97, use_session_context=False),
          "observation": {"images": {"observation/exterior_image_1_left": [[1, 2, 3]]}}},
         differs="the gateway refuses an image that is not HxWx3 numbers in [0, 255] before Redis (the "
                 "fleet carries uint8 HxWx3); upstream hands the lists to the model (the stand-in skips it)"),
    Call("stateless: step 2**64", "POST", "{sid}/step", seeded(step(2**64, use_session_context=False), 5),
         differs="step ids are within [0, 2**63) end to end in the fleet (schemas/limits.py); upstream "
                 "takes any integer for a stateless step"),
    Call("step 2: state only", "POST", "{sid}/step",
         {"step_id": 2, "observation": {"images": step(2)["observation"]["images"], "state": [0.3] * 8,
                                        "extra": {"seed": 7}}, "action": {}},
         same_latent=True, then={"model_metadata.committed_step_id": 2}),
    Call("step 3: empty observation and action", "POST", "{sid}/step",
         {"step_id": 3, "observation": {}, "action": {}}, then={"error": None, "model_metadata.context_length": 4}),
    Call("step: no action", "POST", "{sid}/step", {"step_id": 4, "observation": {}},
         then={"error.param": "body.action"}),
    Call("step: negative id", "POST", "{sid}/step", {**step(4), "step_id": -1}, then={"error.param": "body.step_id"}),
    Call("step: not JSON", "POST", "{sid}/step", raw=b"{\"step_id\": 4,"),
    Call("step: state of strings", "POST", "{sid}/step",
         {"step_id": 4, "observation": {"state": ["x", "y"]}, "action": {}}),
    Call("step: image as a number", "POST", "{sid}/step",
         {"step_id": 4, "observation": {"images": {"cam": 5}}, "action": {}},
         then={"error.param": "body.observation.images.cam"}),
    Call("step: image as a base64 string", "POST", "{sid}/step",
         {"step_id": 4, "observation": {"images": {"cam": "aGVsbG8="}}, "action": {}},
         differs="upstream takes nested lists only (a string is a 400 validation error body); the gateway "
                 "also reads base64 PNG/JPEG/.npy, and this string is neither: a 400 step answer, invalid_request"),
    Call("status", "GET", "{sid}/status"),
    Call("reset", "POST", "{sid}/reset", then={"committed_step_id": -1}),
    Call("step 0 after reset", "POST", "{sid}/step", step(0), same_latent=True),
    Call("close", "POST", "{sid}/close", then={"closed": True}),
    Call("close again", "POST", "{sid}/close", then={"closed": True}),
    Call("status after close", "GET", "{sid}/status", then={"closed": True}),
    Call("step after close", "POST", "{sid}/step", step(1), then={"error.code": "session_closed"}),
    Call("step after close: two joints", "POST", "{sid}/step", step(1, joints=[0.1]),
         then={"error.code": "session_closed"}),
    Call("reset after close", "POST", "{sid}/reset"),
    Call("unknown: step", "POST", f"{UNKNOWN}/step", step(0), then={"error.code": "session_not_found"}),
    Call("unknown: status", "GET", f"{UNKNOWN}/status"),
    Call("unknown: reset", "POST", f"{UNKNOWN}/reset"),
    Call("unknown: close", "POST", f"{UNKNOWN}/close"),
)


@dataclass
class Answer:
    status: int
    body: Any
    headers: httpx.Headers


async def run_script(http: httpx.AsyncClient) -> tuple[str, list[Answer]]:
    sid, answers = "", []
    for call in SCRIPT:
        url = SESSIONS + ("/" + call.path.format(sid=sid) if call.path else "")
        if call.raw is not None:
            r = await http.request(call.method, url, content=call.raw, headers={"Content-Type": "application/json"})
        else:
            r = await http.request(call.method, url, json=call.body)
        answers.append(Answer(r.status_code, r.json(), r.headers))
        if call.name == "create":
            sid = str(r.json()["session_id"])
    return sid, answers


def shape(value: Any) -> Any:
    """Key sets and value types, recursively (a list's shape is its elements')."""
    if isinstance(value, Mapping):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def at(body: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(body, Mapping) or part not in body:
            return KeyError
        body = body[part]
    return body


def differences(call: Call, upstream: Answer, gateway: Answer) -> list[str]:
    found = []
    if upstream.status != gateway.status:
        found.append(f"status {upstream.status} != {gateway.status}")
    if shape(upstream.body) != shape(gateway.body):
        found.append(f"shape {shape(upstream.body)} != {shape(gateway.body)}")
    paths = EQUAL + (LATENT,) * call.same_latent + ("error.message",) * call.same_message
    for path in paths:
        if at(upstream.body, path) != at(gateway.body, path):
            found.append(f"{path}: {at(upstream.body, path)!r} != {at(gateway.body, path)!r}")
    return found


@pytest.fixture(params=["inproc", "http"])
async def gateway(request: pytest.FixtureRequest, redis_server: RedisServer, prefix: str,
                  workers: WorkerPool, omni_server: Service) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway, --upstream-errors, over a worker running the stand-in through a vLLM-Omni engine."""
    await workers.add(inproc_engine() if request.param == "inproc" else http_engine(omni_server))
    settings = GatewaySettings(upstream_errors=True, step_timeout_s=120.0)
    async with GatewayServer(redis_server.url, prefix, model_default=OMNI_MODEL, settings=settings,
                             step_timeout=None) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
        yield http


async def test_the_gateway_answers_as_vllm_omnis_rollout_server(omni_server: Service,
                                                                 gateway: httpx.AsyncClient) -> None:
    async with httpx.AsyncClient(base_url=omni_server.url, timeout=120.0) as upstream:
        upstream_sid, upstream_answers = await run_script(upstream)
    gateway_sid, gateway_answers = await run_script(gateway)
    report = []
    for call, up, gw in zip(SCRIPT, upstream_answers, gateway_answers, strict=True):
        for sid, answer in ((upstream_sid, up), (gateway_sid, gw)):
            assert "x-rollout-duplicate" not in answer.headers, call.name
            if "{sid}" in call.path and isinstance(answer.body, Mapping) and "session_id" in answer.body:
                assert answer.body["session_id"] == sid, call.name
        found = differences(call, up, gw)
        for side, answer in (("upstream", up), ("gateway", gw)):
            found += [f"{side} {path}: {at(answer.body, path)!r}, not {value!r}" for path, value in call.then.items()
                      if at(answer.body, path) != value]
        if call.differs:
            assert found, f"{call.name}: documented as different ({call.differs}) but the answers agree"
        elif found:
            report.append(f"{call.name}: " + "; ".join(found))
    assert not report, "\n".join(report)
