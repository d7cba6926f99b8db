"""The direct-HTTP anchor: a server of the vLLM-Omni rollout API's shape, one POST per step.

Like the reference serving layer (vllm_omni serving_rl_rollout): pydantic request/response
models, an in-process session store with a per-session lock and ``committed_step_id``, the engine
called with a batch of one, and the latent returned as base64 ``video_latent`` + shape + dtype +
encoding. ``python -m bench.http_anchor --port P [--engine null|sim] [--latent-shape 1,16,2,44,80]``
runs it under uvicorn; :class:`HttpRollout` is the httpx client with a connection pool.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from schemas.errors import FleetError
from schemas.latent_json import decode_latent_json, encode_latent_json
from schemas.messages import Mode, parse_step_input
from workers.engines.base import Engine, EngineRequest


class ObservationIn(BaseModel):
    prompt: str = ""
    images: dict[str, Any] = {}
    state: list[float] = []
    extra: dict[str, Any] = {}


class ActionIn(BaseModel):
    joint_positions: list[float] | None = None
    gripper_position: list[float] | None = None
    extra: dict[str, Any] = {}


class CreateSessionIn(BaseModel):
    model: str
    mode: str = "world_model_env"


class StepIn(BaseModel):
    step_id: int
    observation: ObservationIn
    action: ActionIn | None = None
    use_session_context: bool = True


class Metadata(BaseModel):
    latency_ms: float
    steps_generated: int
    context_length: int
    committed_step_id: int


class ErrorOut(BaseModel):
    code: str
    message: str
    step_id: int
    committed_step_id: int


class StepOut(BaseModel):
    step_id: int
    next_observation: dict[str, Any] | None
    model_metadata: Metadata
    error: ErrorOut | None = None


@dataclass
class _Session:
    model: str
    committed: int = -1
    context_length: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def encode_video(latent: np.ndarray) -> dict[str, Any]:
    """The reference's ``_encode_video_output`` for an ndarray."""
    return encode_latent_json(latent)


def decode_video(obs: dict[str, Any]) -> np.ndarray:
    return decode_latent_json(obs)


def _error(req: StepIn, sess: _Session, code: str, message: str) -> StepOut:
    meta = Metadata(latency_ms=0.0, steps_generated=0, context_length=sess.context_length,
                    committed_step_id=sess.committed)
    return StepOut(step_id=req.step_id, next_observation=None, model_metadata=meta,
                   error=ErrorOut(code=code, message=message, step_id=req.step_id,
                                  committed_step_id=sess.committed))


async def _run_step(engine: Engine, sid: str, sess: _Session, req: StepIn) -> StepOut:
    started = time.perf_counter()
    if req.use_session_context and req.step_id != sess.committed + 1:
        return _error(req, sess, "step_out_of_order", f"expected step_id {sess.committed + 1}")
    try:
        step = parse_step_input(Mode.WORLD_MODEL_ENV, req.model_dump(include={"observation", "action"}))
    except FleetError as exc:
        return _error(req, sess, exc.code.value, exc.message)
    request = EngineRequest(session_key=sid, model=sess.model, step=step,
                            reset=sess.committed == -1, stateless=not req.use_session_context)
    out = (await engine.run_batch(sess.model, [request]))[0]  # one request, one forward
    if isinstance(out, BaseException):
        return _error(req, sess, "inference_error", str(out))
    latent = out.output.get("video_latent")
    next_obs = encode_video(latent) if isinstance(latent, np.ndarray) else dict(out.output)
    if req.use_session_context:
        sess.committed, sess.context_length = req.step_id, out.context_length
    meta = Metadata(latency_ms=round((time.perf_counter() - started) * 1000.0, 2), steps_generated=1,
                    context_length=sess.context_length, committed_step_id=sess.committed)
    return StepOut(step_id=req.step_id, next_observation=next_obs, model_metadata=meta)


def make_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    sessions: dict[str, _Session] = {}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/rollout/sessions")
    async def create(req: CreateSessionIn) -> dict[str, Any]:
        if req.model not in engine.models():
            raise HTTPException(400, f"unknown model {req.model!r}")
        sid = uuid.uuid4().hex
        sessions[sid] = _Session(req.model)
        return {"session_id": sid, "mode": req.mode, "created_at": time.time()}

    @app.post("/v1/rollout/sessions/{sid}/step")
    async def step(sid: str, req: StepIn) -> StepOut:
        sess = sessions.get(sid)
        if sess is None:
            raise HTTPException(404, f"session {sid!r} does not exist")
        async with sess.lock:  # the reference serializes one session's steps the same way
            return await _run_step(engine, sid, sess, req)

    return app


class HttpRollout:
    """httpx client of the anchor: one pooled keep-alive connection per concurrent session."""

    def __init__(self, base_url: str, pool: int) -> None:
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        self.client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def ready(self) -> bool:
        return (await self.client.get("/health")).status_code == 200

    async def create_session(self, model: str) -> str:
        resp = await self.client.post("/v1/rollout/sessions", json={"model": model, "mode": "world_model_env"})
        resp.raise_for_status()
        return str(resp.json()["session_id"])

    async def step(self, sid: str, step_id: int, inputs: dict[str, Any]) -> Any:
        resp = await self.client.post(f"/v1/rollout/sessions/{sid}/step", json={"step_id": step_id, **inputs})
        body = resp.json()
        if body.get("error"):
            raise RuntimeError(f"http step failed: {body['error']}")
        obs = body["next_observation"]
        return decode_video(obs) if "video_latent" in obs else obs  # the trainer wants the ndarray


def _build_engine(args: argparse.Namespace) -> Engine:
    if args.engine == "sim":
        from bench.sim_engine import SimEngine, SimEngineConfig

        return SimEngine(SimEngineConfig(args.a_ms, args.b_ms, args.max_batch))
    from workers.engines.null import NullEngine, NullEngineConfig

    shape = tuple(int(x) for x in args.latent_shape.split(",")) if args.latent_shape else (1, 4)
    return NullEngine(NullEngineConfig(latent_shape=shape))


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m bench.http_anchor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", choices=("null", "sim"), default="null")
    parser.add_argument("--latent-shape", default=None, help="null engine latent, e.g. 1,16,2,44,80")
    parser.add_argument("--a-ms", type=float, default=20.0)
    parser.add_argument("--b-ms", type=float, default=0.5)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args(argv)
    app = make_app(_build_engine(args))
    # The plain install (uvicorn without [standard]): asyncio loop and the h11 parser.
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
