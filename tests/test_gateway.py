"""The vLLM-Omni-compatible HTTP gateway over real HTTP (uvicorn in a thread) and a real fleet."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any, Self

import httpx
import numpy as np
import pytest
import uvicorn

from broker import FleetClient
from broker.gateway import create_app
from broker.redis.embedded import RedisServer
from schemas.codec import decode
from schemas.messages import StepResult
from tests.support import WorkerPool, image
from tests.test_multiturn import reference_engine
from workers.engines.null import NullEngine

SESSIONS = "/v1/realtime/sessions"
SHAPE = [1, 4, 2, 8, 10]


class AppServer:
    """uvicorn serving an app on a free port in a background thread (its own event loop)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    async def __aenter__(self) -> Self:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            await asyncio.sleep(0.01)
        raise RuntimeError("the server did not start")

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, 10)
        self.sock.close()


class GatewayServer(AppServer):
    """The gateway's app on a free port."""

    def __init__(self, redis_url: str, prefix: str, **app_options: Any) -> None:
        app_options.setdefault("step_timeout", 30.0)
        super().__init__(create_app(redis_url, prefix=prefix, **app_options))


@pytest.fixture
async def http(redis_server: RedisServer, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    async with GatewayServer(redis_server.url, prefix) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
        yield client


def body(step: int, *, seed: int = 0, images: Any = None, **extra: Any) -> dict[str, Any]:
    img = image(seed * 1000 + step)
    return {"step_id": step,
            "observation": {"prompt": "pick the cup", "state": [0.01 * step] * 8,
                            "images": images if images is not None else {"observation/exterior_image_1_left":
                                                                         img.tolist()}},
            "action": {"joint_positions": [0.1 * ((step + j) % 5) for j in range(7)], "gripper_position": 0.5},
            **extra}


def client_step(step: int, seed: int = 0) -> dict[str, Any]:
    return {"observation": {"prompt": "pick the cup", "state": [0.01 * step] * 8,
                            "images": {"observation/exterior_image_1_left": image(seed * 1000 + step)}},
            "action": {"joint_positions": [0.1 * ((step + j) % 5) for j in range(7)], "gripper_position": [0.5]}}


def latent(next_observation: dict[str, Any]) -> np.ndarray:
    assert next_observation["encoding"] == "base64_raw_tensor"
    raw = base64.b64decode(next_observation["video_latent"])
    return np.frombuffer(raw, dtype=next_observation["dtype"]).reshape(next_observation["shape"])


async def create(http: httpx.AsyncClient, **fields: Any) -> str:
    r = await http.post(SESSIONS, json={"model": "reference-world", **fields})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def error_body(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def step_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    data: dict[str, Any] = r.json()
    assert data["next_observation"] is None and data["error"]["code"] == code
    assert data["model_metadata"]["steps_generated"] == 0
    return data


async def test_session_lifecycle_and_every_status_code(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    r = await http.post(SESSIONS, json={"model": "reference-world", "mode": "world_model_env"})
    assert r.status_code == 200 and set(r.json()) == {"session_id", "mode", "created_at"}
    assert r.json()["mode"] == "world_model_env"
    sid = r.json()["session_id"]
    assert "nope" in error_body(await http.post(SESSIONS, json={"model": "nope"}), 400)["message"]
    tokens = {"model": "reference-world", "mode": "tokens"}
    assert error_body(await http.post(SESSIONS, json=tokens), 400)["param"] == "body.mode"

    first = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
    assert first.status_code == 200 and first.json()["error"] is None
    meta = first.json()["model_metadata"]
    assert meta["committed_step_id"] == 0 and meta["steps_generated"] == 1 and meta["context_length"] == 1
    assert first.json()["next_observation"]["shape"] == SHAPE and first.json()["next_observation"]["dtype"] == "float32"
    gap = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(2)), 400, "step_out_of_order")
    assert gap["error"]["step_id"] == 2 and gap["error"]["committed_step_id"] == 0
    retry = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
    assert retry.status_code == 200 and retry.headers["x-rollout-duplicate"] == "true"
    assert retry.json()["next_observation"] == first.json()["next_observation"]
    for i in range(1, 6):
        assert (await http.post(f"{SESSIONS}/{sid}/step", json=body(i))).status_code == 200
    step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(0)), 400, "step_already_committed")
    stateless = await http.post(f"{SESSIONS}/{sid}/step", json=body(99, use_session_context=False))
    assert stateless.status_code == 200 and stateless.json()["model_metadata"]["committed_step_id"] == 5
    status = await http.get(f"{SESSIONS}/{sid}/status")
    assert status.json() == {"session_id": sid, "committed_step_id": 5, "context_length": 6, "closed": False}

    reset = await http.post(f"{SESSIONS}/{sid}/reset")
    assert reset.json() == {"session_id": sid, "committed_step_id": -1}
    again = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
    assert again.json()["next_observation"] == first.json()["next_observation"]

    assert (await http.post(f"{SESSIONS}/{sid}/close")).json() == {"session_id": sid, "closed": True}
    assert (await http.post(f"{SESSIONS}/{sid}/close")).json() == {"session_id": sid, "closed": True}
    assert (await http.get(f"{SESSIONS}/{sid}/status")).json()["closed"] is True
    step_error(await http.post(f"{SESSIONS}/{sid}/step", json=body(1)), 410, "session_closed")
    assert error_body(await http.post(f"{SESSIONS}/{sid}/reset"), 410)["type"] == "Gone"

    step_error(await http.post(f"{SESSIONS}/missing/step", json=body(0)), 404, "session_not_found")
    for verb, path in (("post", "reset"), ("post", "close"), ("get", "status")):
        r = await http.request(verb.upper(), f"{SESSIONS}/missing/{path}")
        assert error_body(r, 404)["message"] == "Session 'missing' not found."


async def test_invalid_inputs_answer_400(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    url = f"{SESSIONS}/{sid}/step"
    too_bright = (np.full((4, 4, 3), 300)).tolist()
    for images in ({"cam": too_bright}, {"cam": [[[1, 2, 3]], [[1, 2]]]}, {"cam": [[1, 2, 3]]},
                   {"cam": "not base64!"}, {"cam": base64.b64encode(b"not a picture").decode()},
                   {"cam": [[[0.5, 255.5, 2]]]}):
        step_error(await http.post(url, json=body(0, images=images)), 400, "invalid_request")
    no_action = body(0)
    del no_action["action"]
    assert error_body(await http.post(url, json=no_action), 400)["param"] == "body.action"
    assert error_body(await http.post(url, json={**body(0), "step_id": -1}), 400)["param"] == "body.step_id"
    wrong_joints = body(0)
    wrong_joints["action"]["joint_positions"] = [0.1, 0.2]
    step_error(await http.post(url, json=wrong_joints), 400, "invalid_request")
    assert (await http.get(f"{SESSIONS}/{sid}/status")).json()["committed_step_id"] == -1


async def test_inference_error_is_http_200_and_capacity_503(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), max_attempts=1, capacity=1)
    sid = await create(http, model="null-world")
    failed = body(0)
    failed["observation"]["prompt"] = "fail"
    data = step_error(await http.post(f"{SESSIONS}/{sid}/step", json=failed), 200, "inference_error")
    assert data["model_metadata"]["committed_step_id"] == -1
    assert (await http.post(f"{SESSIONS}/{sid}/step", json=body(0))).status_code == 200
    error_body(await http.post(SESSIONS, json={"model": "null-world"}), 503)


async def test_a_create_over_the_trainer_cap_is_429(http: httpx.AsyncClient, workers: WorkerPool,
                                                   fleet: FleetClient) -> None:
    await workers.add(NullEngine())
    await fleet.redis.hset(fleet.keys.trainer_caps, "*", "0")  # the gateway's trainer has no own cap
    assert "its cap is 0" in error_body(await http.post(SESSIONS, json={"model": "null-world"}), 429)["message"]
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0


async def test_msgpack_accept_returns_the_step_result(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    as_json = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
    packed = await http.post(f"{SESSIONS}/{sid}/step", json=body(0), headers={"Accept": "application/msgpack"})
    assert packed.status_code == 200 and packed.headers["content-type"] == "application/msgpack"
    result = StepResult.from_wire(decode(packed.content))
    assert result.ok and result.committed_step_id == 0 and packed.headers["x-rollout-duplicate"] == "true"
    assert result.output is not None
    assert result.output["video_latent"].tobytes() == latent(as_json.json()["next_observation"]).tobytes()
    missing = await http.post(f"{SESSIONS}/missing/step", json=body(0), headers={"Accept": "application/msgpack"})
    assert missing.status_code == 404
    error = StepResult.from_wire(decode(missing.content)).error
    assert error is not None and error.code.value == "session_not_found"


async def test_gateway_and_python_client_give_identical_latents(http: httpx.AsyncClient, fleet: FleetClient,
                                                                workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    direct = await fleet.create_session(model="reference-world", mode="world_model_env")
    for i in range(4):
        img = image(7000 + i)
        encodings = [img.tolist(), _npy(img), "data:image/png;base64," + _png(img), _png(img)]
        r = await http.post(f"{SESSIONS}/{sid}/step",
                            json=body(i, images={"observation/exterior_image_1_left": encodings[i]}))
        assert r.status_code == 200, r.text
        step = client_step(i)
        step["observation"]["images"] = {"observation/exterior_image_1_left": img}
        expected = await direct.step(i, **step)
        assert expected.ok and expected.output is not None
        assert latent(r.json()["next_observation"]).tobytes() == expected.output["video_latent"].tobytes()


async def test_openapi_docs(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    assert {f"{SESSIONS}", f"{SESSIONS}/{{session_id}}/step", f"{SESSIONS}/{{session_id}}/reset",
            f"{SESSIONS}/{{session_id}}/close", f"{SESSIONS}/{{session_id}}/status"} <= set(spec["paths"])
    assert "RolloutStepRequest" in spec["components"]["schemas"]
    assert (await http.get("/docs")).status_code == 200


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _png(array: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()
