"""A stand-in for vLLM-Omni's engine client (``AsyncOmni`` serving DreamZero) that runs the reference
world model, plus a launcher that serves vLLM-Omni's real rollout API around it.

On a GPU the rollout serving layer drives ``AsyncOmni.generate(prompt, request_id,
sampling_params_list)`` with an ``OmniDiffusionRequest`` built by
``ServingRealtimeRobotOpenPI.build_request``; the DreamZero pipeline reads
``sampling_params.extra_args`` (``robot_obs``, ``session_id``, ``reset``) and keeps per-session state.
``ReferenceWorldClient`` does the same on CPU with ``ReferenceWorldModel``: ``robot_obs`` (DROID keys,
images as arrays or nested lists) becomes a ``WorldStep``; the session's hidden state lives under the
engine session id; ``reset`` starts it fresh; ``sampling_params.seed`` is the latent noise seed. The
latent comes back the way DreamZero's formatter places it: ``result.images[0]`` (a float32 tensor).
Bad input raises ``ValueError`` (the serving layer answers ``invalid_request``); a prompt equal to
``fail_prompt`` raises ``RuntimeError`` (``inference_error``), for tests.

Weights, as an engine client's control surface: ``collective_rpc("reload_weights",
kwargs={"weights_path": P})`` reloads the world model from a ``ReferenceEngine.save_weights`` file
(other methods answer ``{"todo": ...}``, as vLLM-Omni's stages do), ``pause_generation`` /
``resume_generation`` hold new requests (pausing waits for running ones), ``reset_prefix_cache``.
With ``VLLM_SERVER_DEV_MODE=1`` the launcher also serves vLLM's development routes (``/pause``,
``/collective_rpc``, ``/reset_prefix_cache``, ``/resume``, ...) around this client, as vLLM-Omni's
API server does.

    python -m bench.world_standin --port 8000 [--latent-shape 1,4,2,8,10] [--seed 0]

serves ``/v1/realtime/sessions...`` of ``vllm_omni.entrypoints.openai.api_server.router`` with
``app.state.rl_rollout_serving = ServingRLRollout(ServingRealtimeRobotOpenPI(ReferenceWorldClient()))``.
Needs vllm-omni (the engines venv).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError
from schemas.messages import GRIPPER_COUNT, JOINT_COUNT, Action, Observation, WorldStep

JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
_NOT_IMAGES = {"prompt", JOINT_KEY, GRIPPER_KEY, "seed", "embodiment_name", "sampling_params"}


def world_step_from_robot_obs(robot_obs: Mapping[str, Any], seed: int | None) -> WorldStep:
    """DreamZero's DROID ``robot_obs`` as our WorldStep (the reference model's input)."""
    prompt = robot_obs.get("prompt", "")
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    images: dict[str, np.ndarray] = {}
    for key, value in robot_obs.items():
        if key in _NOT_IMAGES:
            continue
        array = np.asarray(value)
        if array.ndim != 3 or array.shape[2] != 3:
            continue  # another observation/* field; the reference model has no use for it
        if array.dtype != np.uint8:
            if array.dtype.kind not in "iuf" or (array.size and (array.min() < 0 or array.max() > 255)):
                raise ValueError(f"image {key!r} must hold values in [0, 255]")
            array = array.astype(np.uint8)
        images[key] = array

    def floats(key: str, count: int) -> tuple[float, ...] | None:
        if key not in robot_obs:
            return None
        values = np.asarray(robot_obs[key], dtype=np.float64).reshape(-1)
        if values.size != count:
            raise ValueError(f"{key} must have {count} values, got {values.size}")
        return tuple(float(v) for v in values)

    extra: dict[str, Any] = {} if seed is None else {"seed": int(seed)}
    return WorldStep(Observation(prompt=prompt, images=images, extra=extra),
                     Action(joint_positions=floats(JOINT_KEY, JOINT_COUNT),
                            gripper_position=floats(GRIPPER_KEY, GRIPPER_COUNT)))


class ReferenceWorldClient:
    """The engine-client surface ``ServingRealtimeRobotOpenPI`` / ``ServingRLRollout`` use."""

    def __init__(self, model_name: str = "reference-world", *, seed: int = 0,
                 latent_shape: Sequence[int] = (1, 16, 2, 44, 80), fail_prompt: str | None = "fail",
                 delay_ms: float = 0.0) -> None:
        from workers.engines.reference_world import ReferenceWorldConfig, ReferenceWorldModel

        self.model_name = model_name
        # What ServingRealtimeRobotOpenPI reads to accept a policy model.
        self.model_config = {"policy_server_config": {"model": model_name, "mode": "world_model_env"}}
        self.default_sampling_params_list: list[Any] = []
        self.fail_prompt = fail_prompt
        self.delay_ms = delay_ms
        self._model = ReferenceWorldModel(ReferenceWorldConfig(latent_shape=tuple(latent_shape)), seed=seed)
        self._sessions: dict[str, Any] = {}  # engine session id -> hidden state (torch tensor)
        self._lock = threading.Lock()
        self.requests = 0
        self.reloads: list[str] = []  # weight paths loaded, in order
        self._admission = asyncio.Condition()
        self._paused = False
        self._running = 0

    async def check_health(self) -> None:
        """What vLLM-Omni's ``GET /health`` awaits on the engine client (raises when the engine died);
        this model runs in process, so it is healthy while the server answers."""
        return None

    def session_ids(self) -> list[str]:
        return sorted(self._sessions)

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    async def generate(self, prompt: Any, request_id: str, sampling_params_list: Sequence[Any],
                       **_: Any) -> AsyncIterator[Any]:
        params = sampling_params_list[0]
        extra = dict(getattr(params, "extra_args", None) or {})
        async with self._admission:
            await self._admission.wait_for(lambda: not self._paused)
            self._running += 1
        try:
            if self.delay_ms:
                await asyncio.sleep(self.delay_ms / 1000.0)
            latent = await asyncio.to_thread(self._step, extra, getattr(params, "seed", None))
        finally:
            async with self._admission:
                self._running -= 1
                self._admission.notify_all()
        yield self._output(request_id, prompt, latent)

    # ------------------------------------------------------------------ control surface

    async def collective_rpc(self, method: str, timeout: float | None = None, args: Sequence[Any] = (),
                             kwargs: Mapping[str, Any] | None = None, **_: Any) -> list[Any]:
        if method != "reload_weights":
            return [{"todo": f"the stand-in world model does not implement {method!r}"}]
        path = (kwargs or {}).get("weights_path") or (args[0] if args else None)
        if not path:
            raise ValueError("reload_weights needs weights_path")
        await asyncio.to_thread(self._reload, str(path))
        return [None]

    def _reload(self, path: str) -> None:
        import torch

        from workers.engines.weights import check_state, copy_state

        state = torch.load(path, map_location="cpu", weights_only=True)
        world = {k[len("world."):]: v for k, v in state.items() if k.startswith("world.")}
        if "world_seed" not in state:
            raise ValueError("weights file has no world_seed")
        with self._lock:
            check_state(self._model, world)
            copy_state(self._model, world)
            self._model.reseed_projections(int(state["world_seed"]))
            self.reloads.append(path)

    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True, **_: Any) -> None:
        """Hold new requests and wait for the running ones (a world step cannot be cut short)."""
        async with self._admission:
            self._paused = True
            await self._admission.wait_for(lambda: self._running == 0)

    async def resume_generation(self, **_: Any) -> None:
        async with self._admission:
            self._paused = False
            self._admission.notify_all()

    async def is_paused(self) -> bool:
        return self._paused

    async def reset_prefix_cache(self, *_: Any, **__: Any) -> bool:
        return True  # no prefix cache: session states are kept per session

    def _step(self, extra: Mapping[str, Any], seed: int | None) -> np.ndarray:
        import torch

        session_id = str(extra["session_id"])
        robot_obs = extra.get("robot_obs") or {}
        step = world_step_from_robot_obs(robot_obs, seed)
        if self.fail_prompt is not None and step.observation.prompt == self.fail_prompt:
            raise RuntimeError("stand-in world model: failing on purpose (fail_prompt)")
        with self._lock:
            self.requests += 1
            hidden = None if extra.get("reset") else self._sessions.get(session_id)
            try:
                prepared = self._model.prepare(step)
            except InvalidRequestError as exc:
                raise ValueError(exc.message) from exc
            with torch.no_grad():
                latent, new_hidden = self._model.forward([(hidden, prepared)])[0]
            self._sessions[session_id] = new_hidden
        return latent

    @staticmethod
    def _output(request_id: str, prompt: Any, latent: np.ndarray) -> Any:
        import torch
        from vllm_omni.outputs import OmniRequestOutput

        return OmniRequestOutput.from_diffusion(
            request_id=request_id, images=[torch.from_numpy(latent)], prompt=prompt,
            final_output_type="latents", multimodal_output={"actions": np.zeros((1, 8), dtype=np.float32)},
        )


def build_serving(client: Any, model_name: str | None = None) -> Any:
    """vLLM-Omni's real rollout serving objects around an engine client."""
    from vllm_omni.entrypoints.openai.serving_rl_rollout import ServingRLRollout
    from vllm_omni.entrypoints.openpi.serving import ServingRealtimeRobotOpenPI

    name = model_name or getattr(client, "model_name", None)
    return ServingRLRollout(ServingRealtimeRobotOpenPI(engine_client=client, model_name=name))


def build_app(client: Any, model_name: str | None = None) -> Any:
    """A FastAPI app with vLLM-Omni's router, vLLM's exception handlers and the rollout serving state."""
    from fastapi import FastAPI
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm_omni.entrypoints.openai.api_server import router

    app = FastAPI()
    app.include_router(router)
    # vLLM's error bodies, as vLLM-Omni's server gets them from vLLM's app builder: an HTTPException
    # or a malformed body answers {"error": {...}} (a malformed body: 400, not FastAPI's 422).
    init_exception_handler(app)
    app.state.args = argparse.Namespace(log_error_stack=False)
    app.state.rl_rollout_serving = build_serving(client, model_name)
    app.state.engine_client = client
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        from vllm.entrypoints.serve import register_vllm_dev_api_routers

        register_vllm_dev_api_routers(app)
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description="vLLM-Omni rollout API around the reference world model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="reference-world")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latent-shape", default="1,16,2,44,80")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    shape = tuple(int(d) for d in args.latent_shape.split(","))
    client = ReferenceWorldClient(args.model, seed=args.seed, latent_shape=shape, delay_ms=args.delay_ms)
    uvicorn.run(build_app(client), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
