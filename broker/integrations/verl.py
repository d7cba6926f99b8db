"""verl agent loops that roll out on the fleet: a server manager with verl's ``generate`` signature.

verl (0.9.x) agent loops call ``await self.server_manager.generate(request_id=..., prompt_ids=...,
sampling_params=..., image_data=..., ...)`` and read a ``TokenOutput`` (``token_ids``, ``log_probs``,
``routed_experts``, ``stop_reason``; ``extra_fields`` here add the fleet's ``finish_reason`` and
``stop_reason``: the stop string or stop token id, else None). :class:`FleetServerManager` answers
that call on the fleet:

- each ``request_id`` is a fleet session (sticky): its first call sends the whole prompt, later
  calls send only the tokens after the session's context (the worker keeps the context). When a
  later prompt does not extend the context (the agent loop rewrote the history), the old session is
  closed and a fresh one gets the whole prompt;
- ``close(request_id)`` / ``aclose()`` close sessions; a session nobody closes is closed by its
  worker after ``idle_timeout_s``.

verl's config chooses it through ``actor_rollout_ref.rollout.agent.agent_loop_config_path``: a YAML
list naming ``broker.integrations.verl.FleetSingleTurnAgentLoop`` or ``FleetToolAgentLoop`` (verl's
own SingleTurnAgentLoop / ToolAgentLoop, unchanged, with this server manager in place of verl's and
their sessions closed when the loop ends) and the fleet settings as keys: ``fleet_redis_url``,
``fleet_prefix``, ``fleet_cell``, ``fleet_model``, ``fleet_step_timeout``, ``fleet_max_staleness``,
``fleet_idle_timeout_s``, ``fleet_return_routed_experts``. verl is imported only when those classes are
asked for, so the server manager works without verl installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from broker.client import DEFAULT_URL, FleetClient, Session
from broker.integrations.vime import fleet_for
from schemas.results import StepResult

DEFAULT_MODEL = "reference-lm"
DEFAULT_IDLE_TIMEOUT_S = 600.0
# verl's sampling keys the fleet's token step takes (renamed where verl names them differently).
_SAMPLING_RENAMES = {"max_tokens": "max_tokens", "max_new_tokens": "max_tokens", "temperature": "temperature",
                     "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop_token_ids": "stop_token_ids"}
# vLLM sampling keys the fleet's token step takes as they are, sent only when not vLLM's default (so a
# plain verl config's step is what it always was).
_PASSED = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
           "stop": None}
# Keys verl sends that change nothing on the fleet: the fleet always returns the sampled tokens' log
# probs (verl's TokenOutput has no place for more), one sample per request, token ids without text.
_NEUTRAL = {"logprobs": None, "n": 1, "detokenize": None, "skip_special_tokens": None,
            "include_stop_str_in_output": None}


class VerlFleetError(RuntimeError):
    """A step the fleet refused: ``code`` is the fleet's error code, ``request_id`` verl's."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id}: {code}: {message}")
        self.request_id, self.code = request_id, code


def fleet_sampling(sampling_params: Mapping[str, Any], response_length: int | None = None) -> dict[str, Any]:
    """verl's ``sampling_params`` as the fleet's ``sampling``. ``top_k`` -1 (verl's "off") is 0 here;
    ``max_tokens`` defaults to ``response_length``; the penalties, ``min_tokens`` and ``stop`` strings
    go as they are. A key the fleet cannot honour is refused, never ignored: ``n`` other than 1,
    ``logprobs`` other than 0/1/None, ..."""
    sampling: dict[str, Any] = {}
    for key, value in sampling_params.items():
        if key in _SAMPLING_RENAMES:
            if value is not None:
                sampling[_SAMPLING_RENAMES[key]] = value
        elif key in _PASSED:
            if value is not None and value != _PASSED[key]:
                sampling[key] = value
        elif key in _NEUTRAL:
            _check_neutral(key, value)
        else:
            raise ValueError(f"sampling_params[{key!r}] is not a sampling parameter the fleet knows")
    if "max_tokens" not in sampling and response_length is not None:
        sampling["max_tokens"] = int(response_length)
    if sampling.get("top_k") is not None and int(sampling["top_k"]) < 0:
        sampling["top_k"] = 0
    return sampling


def _check_neutral(key: str, value: Any) -> None:
    """Refuse a value of a neutral key that would change what verl gets."""
    if key == "logprobs" and value in (None, False, 0, 1, True):
        return
    if value != _NEUTRAL[key] and _NEUTRAL[key] is not None:
        raise ValueError(f"sampling_params[{key!r}] = {value!r} is not supported by the fleet")
    if key == "logprobs":
        raise ValueError(f"sampling_params['logprobs'] = {value!r}: the fleet returns the sampled "
                         "tokens' log probs only")


@dataclass
class _Track:
    """One request_id's fleet session and the tokens its worker holds."""

    session: Session
    context: list[int] = field(default_factory=list)
    next_step: int = 0
    routed: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True)
class FleetSettings:
    """Where and how the server manager rolls out (the ``fleet_*`` keys of the agent loop config)."""

    redis_url: str = DEFAULT_URL
    prefix: str = "rf"
    cell: str = "0"
    model: str = DEFAULT_MODEL
    step_timeout: float | None = None
    max_staleness: int | None = None
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    return_routed_experts: bool = False

    @classmethod
    def from_kwargs(cls, values: Mapping[str, Any]) -> FleetSettings:
        """From ``fleet_*`` keyword arguments; unknown ``fleet_*`` keys are refused."""
        known = {f"fleet_{name}" for name in cls.__dataclass_fields__}
        unknown = sorted(key for key in values if key.startswith("fleet_") and key not in known)
        if unknown:
            raise ValueError(f"unknown fleet settings {unknown}; known: {sorted(known)}")
        return cls(**{key.removeprefix("fleet_"): value for key, value in values.items()
                      if key in known and value is not None})


class FleetServerManager:
    """verl's server manager (``generate(request_id, *, prompt_ids, sampling_params, ...) ->
    TokenOutput``) backed by fleet sessions, one per ``request_id``."""

    def __init__(self, settings: FleetSettings | None = None, *, fleet: FleetClient | None = None,
                 response_length: int | None = None) -> None:
        self.settings = settings or FleetSettings()
        self._fleet = fleet
        self.response_length = response_length
        self._tracks: dict[str, _Track] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def fleet(self) -> FleetClient:
        if self._fleet is None:
            s = self.settings
            self._fleet = await fleet_for(s.redis_url, s.prefix, s.cell)
        return self._fleet

    @property
    def open_requests(self) -> list[str]:
        return list(self._tracks)

    async def generate(self, request_id: str, *, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       image_data: Sequence[Any] | None = None, video_data: Sequence[Any] | None = None,
                       audio_data: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """One generation on ``request_id``'s session; a verl ``TokenOutput`` when verl is installed,
        else a dict with its fields."""
        if image_data or video_data or audio_data:
            raise ValueError("multimodal prompts are not supported by the verl fleet adapter yet")
        prompt = [int(t) for t in prompt_ids]
        sampling = fleet_sampling(sampling_params, self.response_length)
        lock = self._locks.setdefault(request_id, asyncio.Lock())
        async with lock:  # one request_id's turns go in order, on one session
            track = await self._track_for(request_id, prompt)
            return await self._step(request_id, track, prompt, sampling)

    async def _track_for(self, request_id: str, prompt: list[int]) -> _Track:
        track = self._tracks.get(request_id)
        if track is not None and len(prompt) > len(track.context) and prompt[:len(track.context)] == track.context:
            return track
        if track is not None:  # the history was rewritten: the worker's context is of no use
            await self.close(request_id)
        s = self.settings
        session = await (await self.fleet()).create_session(
            s.model, "tokens", idle_timeout_s=s.idle_timeout_s, max_staleness=s.max_staleness)
        track = self._tracks[request_id] = _Track(session)
        return track

    async def _step(self, request_id: str, track: _Track, prompt: list[int], sampling: dict[str, Any]) -> Any:
        s = self.settings
        new = prompt[len(track.context):]
        result = await track.session.step(track.next_step, token_ids=new, sampling=sampling,
                                          return_routed_experts=s.return_routed_experts, timeout=s.step_timeout)
        if not result.ok:
            await self._refused(request_id, track, result)
        track.next_step += 1
        output = dict(result.output or {})
        tokens = [int(t) for t in output.get("token_ids") or []]
        log_probs = [float(x) for x in output.get("logprobs") or []]
        if len(log_probs) != len(tokens):
            raise VerlFleetError(request_id, "internal", f"{len(tokens)} tokens, {len(log_probs)} log probs")
        finish = str(output.get("finish_reason"))
        track.context = prompt + tokens
        routed = output.get("routed_experts")
        if isinstance(routed, np.ndarray):
            track.routed.append(routed)
        fields = {
            "token_ids": tokens, "log_probs": log_probs,
            "routed_experts": np.concatenate(track.routed, axis=0) if track.routed else None,
            "stop_reason": "aborted" if finish in ("abort", "cancelled") else "completed",
            "extra_fields": {"finish_reason": finish, "stop_reason": output.get("stop_reason"),
                             "policy_version": result.policy_version,
                             "global_steps": result.policy_version, "fleet_session_id": track.session.session_id},
        }
        return _token_output(fields)

    async def _refused(self, request_id: str, track: _Track, result: StepResult) -> NoReturn:
        """A refused request leaves a session with a context as it was (verl may retry the turn);
        a session that never held one, or one the fleet failed, is closed."""
        error = result.error
        code = error.code.value if error else "unknown"
        if code != "invalid_request" or not track.context:
            await self.close(request_id)
        raise VerlFleetError(request_id, code, error.message if error else "")

    async def close(self, request_id: str) -> None:
        """Close ``request_id``'s session (nothing to do when it has none)."""
        track = self._tracks.pop(request_id, None)
        self._locks.pop(request_id, None)
        if track is not None:
            await track.session.close()

    async def aclose(self) -> None:
        """Close every open session of this manager."""
        for request_id in list(self._tracks):
            await self.close(request_id)


def _token_output(fields: dict[str, Any]) -> Any:
    try:
        from verl.workers.rollout.replica import TokenOutput
    except ImportError:  # a trainer without verl gets the same fields as a dict
        return fields
    return TokenOutput(**fields)


def _fleet_loop_class(base: Any, name: str) -> type:
    """A subclass of the verl agent loop ``base`` that rolls out on the fleet: verl's loop code runs
    unchanged, its server manager is a :class:`FleetServerManager` and its sessions close at the end."""

    base_run = base.run

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        fleet_keys = {key: kwargs.pop(key) for key in list(kwargs) if key.startswith("fleet_")}
        base.__init__(self, *args, **kwargs)
        response_length = getattr(self.rollout_config, "response_length", None)
        self.server_manager = FleetServerManager(FleetSettings.from_kwargs(fleet_keys),
                                                 response_length=response_length)

    async def run(self: Any, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        try:
            return await base_run(self, sampling_params, **kwargs)
        finally:
            await self.server_manager.aclose()

    cls = type(name, (base,), {"__init__": __init__, "run": run, "__module__": __name__,
                               "__doc__": f"verl's {base.__name__}, rolling out on the fleet."})
    cls.__qualname__ = name
    return cls


_LOOPS = {"FleetSingleTurnAgentLoop": ("verl.experimental.agent_loop.single_turn_agent_loop", "SingleTurnAgentLoop"),
          "FleetToolAgentLoop": ("verl.experimental.agent_loop.tool_agent_loop", "ToolAgentLoop")}
_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``FleetSingleTurnAgentLoop`` / ``FleetToolAgentLoop``, built (importing verl) on first use so
    that hydra's ``_target_`` finds them and a process without verl imports this module fine."""
    if name not in _LOOPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        import importlib

        module, base = _LOOPS[name]
        _BUILT[name] = _fleet_loop_class(getattr(importlib.import_module(module), base), name)
    return _BUILT[name]
