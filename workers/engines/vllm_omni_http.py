"""vLLM-Omni over HTTP: a worker that fronts one vLLM-Omni server's RL-rollout API.

    POST /v1/realtime/sessions                      {"model", "mode": "world_model_env"}
    POST /v1/realtime/sessions/{id}/step            {"step_id", "observation", "action", "use_session_context"}
    POST /v1/realtime/sessions/{id}/reset | close
    GET  /v1/realtime/sessions/{id}/status          {"committed_step_id", "context_length", "closed"}

Each fleet session (engine session key) maps to one server session, created on its first step.
Fleet step ids and server step ids are separate: the server numbers its steps from 0 after each
create/reset, and this engine sends ``server committed + 1``. A fleet reset (``request.reset``) resets
the server session; ``drop_session`` closes it (in the background: the call is synchronous).
Stateless steps (key ``<sid>:stateless``) go to a server session of their own with
``use_session_context=false``.

Answers: the latent comes back base64 (raw bytes, ``shape``, ``dtype``) and is decoded into an
ndarray. HTTP 200 with ``error`` (``inference_error``) -> ``TransientEngineError`` (retried);
400 ``invalid_request`` -> ``InvalidRequestError``. A lost answer (timeout, connection error, 5xx)
is followed by ``/status``: if the server did not commit the step, the retry resends it; if it did,
the latent is gone and the server's context is ahead of the fleet's, so the engine closes that
server session and raises ``ContextLost`` (code ``context_lost``) until the session is rebuilt
from a reset step. 404/410 for a session this worker holds also mean its context is gone.

Weights: ``load_weights`` runs the server engine's own reload through its development routes
(``VLLM_SERVER_DEV_MODE=1``, as for the vLLM HTTP engine): ``/pause?mode=wait``, ``/collective_rpc``
``reload_weights``, ``/reset_prefix_cache``, ``/resume``. A world step is not aborted part way
(the server session would be left ahead of the fleet): an aborting update lets it finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from schemas.errors import ContextLost, InvalidRequestError, TransientEngineError
from schemas.latent_json import decode_latent_json
from schemas.messages import Mode, WorldStep
from workers.engines.base import EngineOutput, EngineRequest, run_in_waves
from workers.engines.http_common import ServerEngine, check_response
from workers.engines.vllm_omni_engine import world_step

log = logging.getLogger(__name__)
Result = EngineOutput | BaseException
PREFIX = "/v1/realtime/sessions"
_LOST_ANSWER = (httpx.TimeoutException, httpx.TransportError)


@dataclass(frozen=True)
class VLLMOmniHTTPConfig:
    """``base_url``: the vLLM-Omni server. ``model``: the fleet's model name; ``server_model``: the
    name the server serves (default: ``model``)."""

    base_url: str
    model: str = "dreamzero"
    server_model: str | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_connections: int = 64
    max_batch_size: int = 16
    batches_in_flight: int = 4  # the server batches continuously: see Engine.batches_in_flight
    default_seed: int | None = 0  # as VLLMOmniEngineConfig.default_seed


@dataclass
class _Remote:
    server_id: str
    committed: int = -1  # the server's committed step id, as this engine knows it
    steps: int = 0  # steps in the context (our context length)
    uncertain: bool = False  # an answer was lost: ask /status before the next step


def step_body(step: WorldStep, step_id: int, contextual: bool, default_seed: int | None = None) -> dict[str, Any]:
    """Our world step as a ``RolloutStepRequest`` (images as nested lists, as the API takes them);
    ``observation.extra["seed"]`` defaults to ``default_seed``."""
    obs = step.observation
    joints, gripper = step.given_robot_state()  # None stays None: the server invents no zeros either
    extra = dict(obs.extra)
    if "seed" not in extra and default_seed is not None:
        extra["seed"] = default_seed
    return {
        "step_id": step_id,
        "observation": {
            "images": {name: np.asarray(image).tolist() for name, image in obs.images.items()},
            "state": list(obs.state) or None,
            "prompt": obs.prompt,
            "extra": extra,
        },
        "action": {"joint_positions": None if joints is None else list(joints),
                   "gripper_position": None if gripper is None else list(gripper),
                   "extra": dict(step.action.extra) if step.action else {}},
        "use_session_context": contextual,
    }


def decode_latent(next_observation: Mapping[str, Any]) -> np.ndarray:
    """The ``next_observation`` of a step answer (``base64_raw_tensor``) as an ndarray."""
    try:
        return decode_latent_json(next_observation).copy()  # writable: engines may update it in place
    except InvalidRequestError as exc:  # the server's answer is bad, not the trainer's request
        raise TransientEngineError(str(exc)) from exc


class VLLMOmniHTTPEngine(ServerEngine):
    """Serves ``config.model`` (world_model_env) by calling one vLLM-Omni server."""

    kind = "vllm-omni-http"
    config_type = VLLMOmniHTTPConfig
    mode = Mode.WORLD_MODEL_ENV
    server_keeps_version = False

    def __init__(self, config: VLLMOmniHTTPConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config, transport)
        self.config = config
        self._remotes: dict[str, _Remote] = {}
        self._lost: set[str] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._pending_close: list[str] = []

    def server_session(self, session_key: str) -> str | None:
        """The server's session id for one of ours (for tests and diagnostics)."""
        remote = self._remotes.get(session_key)
        return None if remote is None else remote.server_id

    def session_keys(self) -> list[str]:
        return sorted(self._remotes)

    async def start(self) -> None:
        self._http()

    async def close(self) -> None:
        for key in list(self._remotes):
            self.drop_session(key)
        await self._flush_closes()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        await self._close_http()

    # ------------------------------------------------------------------ sessions

    def drop_session(self, session_key: str) -> None:
        self._lost.discard(session_key)
        remote = self._remotes.pop(session_key, None)
        if remote is None:
            return
        self._pending_close.append(remote.server_id)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # closed at the next batch or at close()
        task = loop.create_task(self._flush_closes())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _flush_closes(self) -> None:
        ids, self._pending_close = self._pending_close, []
        for server_id in ids:
            try:
                response = await self._http().post(f"{PREFIX}/{server_id}/close")
                if response.status_code >= 300 and response.status_code != 404:
                    log.warning("closing server session %s: HTTP %d", server_id, response.status_code)
            except httpx.HTTPError as exc:
                log.warning("closing server session %s failed: %s", server_id, exc)

    async def _request(self, method: str, path: str, what: str, body: Mapping[str, Any] | None = None) -> Any:
        try:
            response = await self._http().request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise TransientEngineError(f"{what}: timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise TransientEngineError(f"{what}: {type(exc).__name__}: {exc}") from exc
        return check_response(response, what)

    async def _create(self) -> _Remote:
        created = await self._request("POST", PREFIX, "create session",
                                      {"model": self.server_model, "mode": "world_model_env"})
        return _Remote(server_id=str(created["session_id"]))

    async def _remote_for(self, request: EngineRequest) -> _Remote:
        key = request.session_key
        fresh = request.reset or request.stateless
        if key in self._lost and not fresh:
            raise ContextLost(f"the server's context of {key} was lost; the session must be rebuilt")
        remote = self._remotes.get(key)
        if remote is None:
            remote = await self._create()
            self._remotes[key] = remote
            self._lost.discard(key)
            return remote
        if request.reset and (remote.committed >= 0 or remote.uncertain):
            answer = await self._request("POST", f"{PREFIX}/{remote.server_id}/reset", "reset session")
            remote.committed = int(answer.get("committed_step_id", -1))
            remote.steps = 0
            remote.uncertain = False
            self._lost.discard(key)
        elif remote.uncertain and not request.stateless:
            await self._reconcile(key, remote, remote.committed + 1)
        return remote

    async def _reconcile(self, key: str, remote: _Remote, step_id: int) -> None:
        """After a lost answer for ``step_id``: did the server commit it? Raises if the context is lost."""
        status = await self._request("GET", f"{PREFIX}/{remote.server_id}/status", "session status")
        committed = int(status.get("committed_step_id", -1))
        if status.get("closed") or committed >= step_id:
            self._forget(key, remote)
            raise ContextLost(f"server session {remote.server_id} committed step {committed} whose answer "
                                     "was lost; its context is ahead of the fleet's")
        remote.committed = committed
        remote.uncertain = False

    def _forget(self, key: str, remote: _Remote) -> None:
        self._remotes.pop(key, None)
        self._lost.add(key)
        self._pending_close.append(remote.server_id)

    # ------------------------------------------------------------------ steps

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[Result]:
        if (refused := self.refuse_unknown_model(model, requests)) is not None:
            return refused
        await self._flush_closes()
        return await run_in_waves(requests, self._run_one)

    async def _run_one(self, request: EngineRequest) -> EngineOutput:
        step = world_step(request)
        key = request.session_key
        remote = await self._remote_for(request)
        contextual = not request.stateless
        step_id = remote.committed + 1 if contextual else 0
        body = step_body(step, step_id, contextual, self.config.default_seed)
        try:
            response = await self._http().post(f"{PREFIX}/{remote.server_id}/step", json=body)
        except _LOST_ANSWER as exc:
            return await self._lost_answer(key, remote, step_id, contextual, f"{type(exc).__name__}: {exc}")
        if response.status_code >= 500:
            return await self._lost_answer(key, remote, step_id, contextual, f"HTTP {response.status_code}")
        try:
            answer = response.json()
        except ValueError:
            answer = None
        error = answer.get("error") if isinstance(answer, Mapping) else None
        if error:
            return await self._step_error(key, remote, step_id, response.status_code, error)
        if response.status_code >= 300 or not isinstance(answer, Mapping):
            check_response(response, "step")  # raises the mapped error
            raise TransientEngineError(f"step: unexpected answer {str(answer)[:200]}")
        latent = decode_latent(answer.get("next_observation") or {})
        if not contextual:
            return EngineOutput(output={"video_latent": latent}, context_length=1)
        remote.committed = step_id
        remote.steps += 1
        return EngineOutput(output={"video_latent": latent}, context_length=remote.steps)

    async def _lost_answer(self, key: str, remote: _Remote, step_id: int, contextual: bool,
                           why: str) -> EngineOutput:
        if contextual:
            remote.uncertain = True
            with contextlib.suppress(TransientEngineError):  # unreachable: check again before the next step
                await self._reconcile(key, remote, step_id)
        raise TransientEngineError(f"step {step_id} of server session {remote.server_id}: {why}")

    async def _step_error(self, key: str, remote: _Remote, step_id: int, status: int,
                          error: Mapping[str, Any]) -> EngineOutput:
        code = str(error.get("code", ""))
        message = f"server session {remote.server_id} step {step_id}: {code}: {error.get('message', '')}"
        if code == "invalid_request":
            raise InvalidRequestError(message)
        if code in ("session_not_found", "session_closed"):
            self._forget(key, remote)
            raise ContextLost(message)
        if code in ("step_already_committed", "step_out_of_order"):
            remote.uncertain = True
            await self._reconcile(key, remote, step_id)  # raises if the server is ahead
            raise TransientEngineError(message)
        raise TransientEngineError(message)  # inference_error (HTTP 200) and anything new
