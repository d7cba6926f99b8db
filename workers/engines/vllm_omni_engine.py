"""vLLM-Omni in process: world-model sessions on vLLM-Omni's engine client, the way its RL-rollout
serving layer drives it.

Per step: the observation and action become DreamZero's DROID ``robot_obs`` (``prompt``, the named
camera images, ``observation/joint_position`` (7), ``observation/gripper_position`` (1), and the
``observation/*``, ``seed`` and ``embodiment_name`` keys of ``observation.extra``; ``seed`` defaults
to ``default_seed``, so every request carries one);
``ServingRealtimeRobotOpenPI.build_request`` turns it into the engine request (session id and reset
flag in the sampling params' ``extra_args``), ``engine_client.generate(...)`` runs it, and the video
latent is read from ``result.images`` or ``multimodal_output["video"]``. ``reset`` is set on the
first step after create/reset, on stateless steps and whenever this worker holds no context for the
session. Stateless steps run in their own engine session (the worker names it ``<sid>:stateless``).
``drop_session`` (reset/close/handover) drops the engine session too.

Output: ``{"video_latent": float32 ndarray}``; context length = steps in the session's context.

Weights: ``load_weights`` is the engine client's own reload, ``collective_rpc("reload_weights",
kwargs={"weights_path": ...})`` on every stage, then ``reset_prefix_cache()``; a stage that does
not implement it answers ``{"todo": ...}`` and the update fails with that reason (the old weights
keep serving). Session contexts are kept across a reload, as the in-process vLLM engine keeps them.

The engine client is injectable: ``engine_client=`` (an object), or ``client_factory="module:callable"``
with ``client_options`` (e.g. the CPU stand-in of the tests, ``bench.world_standin:ReferenceWorldClient``);
by default ``vllm_omni.entrypoints.async_omni.AsyncOmni(model=weights, **client_options)`` (DreamZero
on a GPU). vllm_omni is imported when the engine starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError
from schemas.messages import Mode, WorldStep
from workers.engines.base import Engine, EngineOutput, EngineRequest, run_in_waves
from workers.engines.http_common import check_rpc_results
from workers.engines.registry import load_object

log = logging.getLogger(__name__)
Result = EngineOutput | BaseException
EXTRA_KEYS = ("seed", "embodiment_name")


def robot_obs(step: WorldStep, default_seed: int | None = None) -> dict[str, Any]:
    """The DROID ``robot_obs`` of one step (what the rollout serving layer builds). ``seed`` (the
    engine's sampling seed) is ``observation.extra["seed"]``, else ``default_seed``."""
    obs = step.observation
    out: dict[str, Any] = {"prompt": obs.prompt}
    out.update(obs.images)
    for key, value in obs.extra.items():
        if key.startswith("observation/") or key in EXTRA_KEYS:
            out[key] = value
    if "seed" not in out and default_seed is not None:
        out["seed"] = default_seed
    # A step with neither action values nor a state leaves the keys out, as upstream does.
    joints, gripper = step.given_robot_state()
    if joints is not None:
        out["observation/joint_position"] = np.asarray(joints, dtype=np.float64)
    if gripper is not None:
        out["observation/gripper_position"] = np.asarray(gripper, dtype=np.float64)
    return out


def world_step(request: EngineRequest) -> WorldStep:
    if not isinstance(request.step, WorldStep):
        raise InvalidRequestError(f"vLLM-Omni engines take world-model steps, got {type(request.step).__name__}")
    return request.step


def latent_array(video: Any) -> np.ndarray:
    """A video latent (torch tensor or array) as a float32 ndarray on the CPU."""
    if hasattr(video, "detach"):
        video = video.detach().float().cpu().numpy()
    array = np.asarray(video)
    if array.dtype != np.float32:
        array = array.astype(np.float32)
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class VLLMOmniEngineConfig:
    """``model``: the name sessions ask for. ``weights``: what AsyncOmni loads (default: ``model``).
    ``client_factory`` / ``client_options``: how to build the engine client (see the module doc).
    ``default_seed``: the sampling seed of steps whose ``observation.extra`` has none (vLLM-Omni
    otherwise draws a random one per request, and results would not be reproducible)."""

    model: str = "dreamzero"
    weights: str | None = None
    client_factory: str | None = None
    client_options: Mapping[str, Any] = field(default_factory=dict)
    max_batch_size: int = 16
    default_seed: int | None = 0


class VLLMOmniEngine(Engine):
    """Serves one world model (``world_model_env``) through vLLM-Omni's engine client."""

    kind = "vllm-omni"
    config_type = VLLMOmniEngineConfig

    def __init__(self, config: VLLMOmniEngineConfig | None = None, *, engine_client: Any = None) -> None:
        self.config = config or VLLMOmniEngineConfig()
        self._client = engine_client
        self._openpi: Any = None
        self._steps: dict[str, int] = {}  # session key -> steps in its engine context

    def models(self) -> Mapping[str, Mode]:
        return {self.config.model: Mode.WORLD_MODEL_ENV}

    def max_batch_size(self, model: str) -> int:
        return self.config.max_batch_size

    @property
    def engine_client(self) -> Any:
        return self._client

    async def start(self) -> None:
        if self._openpi is not None:
            return
        from vllm_omni.entrypoints.openpi.serving import ServingRealtimeRobotOpenPI

        cfg = self.config
        if self._client is None:
            if cfg.client_factory:
                self._client = load_object(cfg.client_factory)(**dict(cfg.client_options))
            else:
                from vllm_omni.entrypoints.async_omni import AsyncOmni

                self._client = AsyncOmni(model=cfg.weights or cfg.model, **dict(cfg.client_options))
        self._openpi = ServingRealtimeRobotOpenPI(engine_client=self._client, model_name=cfg.model)

    async def close(self) -> None:
        for key in list(self._steps):
            self.drop_session(key)
        client, self._client, self._openpi = self._client, None, None
        shutdown = getattr(client, "shutdown", None)
        if callable(shutdown):
            result = shutdown()
            if asyncio.iscoroutine(result):
                await result

    async def load_weights(self, path: str, version: int) -> None:
        """The engine client's own reload (see the module doc); only called between steps."""
        await self.start()
        results = await self._client.collective_rpc("reload_weights", kwargs={"weights_path": path})
        check_rpc_results(results, "reload_weights")
        reset = getattr(self._client, "reset_prefix_cache", None)
        if callable(reset) and not await reset():
            raise RuntimeError("reset_prefix_cache failed after reloading the weights")
        self._version = version

    def drop_session(self, session_key: str) -> None:
        self._steps.pop(session_key, None)
        if self._openpi is None:
            return
        try:
            self._openpi.drop_session(session_key)
        except Exception:
            log.exception("dropping engine session %s failed", session_key)

    def session_keys(self) -> list[str]:
        return sorted(self._steps)

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[Result]:
        if (refused := self.refuse_unknown_model(model, requests)) is not None:
            return refused
        await self.start()
        return await run_in_waves(requests, self._run_one)

    async def _run_one(self, request: EngineRequest) -> EngineOutput:
        from vllm_omni.entrypoints.openai.serving_rl_rollout import ServingRLRollout

        step = world_step(request)
        key = request.session_key
        reset = request.reset or request.stateless or key not in self._steps
        obs = robot_obs(step, self.config.default_seed)
        try:
            engine_request = self._openpi.build_request(obs, session_id=key, reset=reset)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(str(exc)) from exc
        prompt = getattr(engine_request, "prompt", None)
        if prompt is None:
            prompt = engine_request.prompts[0]
        result = None
        try:
            async for output in self._client.generate(prompt=prompt, request_id=engine_request.request_id,
                                                      sampling_params_list=[engine_request.sampling_params]):
                result = output
        except ValueError as exc:  # the model rejected the input
            raise InvalidRequestError(str(exc)) from exc
        if result is None:
            raise RuntimeError("world model request produced no output")
        error = getattr(result, "error", None)
        if error:
            raise RuntimeError(f"world model request failed: {error}")
        latent = latent_array(ServingRLRollout._extract_video_output(result))
        steps = (0 if reset else self._steps.get(key, 0)) + 1
        if not request.stateless:
            self._steps[key] = steps
        return EngineOutput(output={"video_latent": latent}, context_length=steps)
