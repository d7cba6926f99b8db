"""Multi-turn token rollouts on the fleet: the trainer side of an interaction rollout.

One fleet session per sample and one step per turn. Step 0 carries the rendered prompt; every
later step carries only the tokens the worker has not seen yet (the boundary of the next user
turn, and an EOS the driver appended after a stop string), because the worker keeps the
session's context. The sample's token list and the worker's context therefore stay identical,
token for token, which is what makes the log probs and routed experts line up for training.

    async with FleetClient(url) as fleet:
        sample = await run_multiturn(fleet, env, [{"role": "user", "content": question}],
                                     MultiTurnConfig(max_turns=3, max_new_tokens=256))
        sample.tokens, sample.loss_mask, sample.rollout_log_probs, sample.status

Budgets follow the vime rollout: ``max_new_tokens`` bounds the whole response (generated and
observation tokens), a context limit shrinks it further, each turn asks for what is left, and an
observation that would leave no room to answer truncates the sample.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
from redis.exceptions import RedisError

from broker.client import FleetClient, Session
from broker.rollouts.chat_tokens import (
    ChatTokenizer,
    check_text_message,
    eos_id,
    observation_token_ids,
    stop_ids,
    template_ids,
)
from broker.rollouts.render import ChatRenderer, has_images
from schemas.errors import ErrorCode, FleetError
from schemas.messages import StepResult
from schemas.reference_tokenizer import ReferenceTokenizer

_SEED_SPACE = 1 << 62


def draw_seed() -> int:
    """A fresh sampling seed (kept in the sample's metadata, so the sample can be reproduced)."""
    return random.SystemRandom().randrange(_SEED_SPACE)


class Environment(Protocol):
    """An interaction environment: ``step`` takes the model's text of one turn."""

    def reset(self) -> Any: ...

    def step(self, response: str, /) -> tuple[Any, bool, Any]: ...

    def format_observation(self, observation: Any, /) -> Mapping[str, Any]: ...

    def close(self) -> None: ...


class RolloutStatus(StrEnum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True)
class MultiTurnConfig:
    """How one sample rolls out. ``seed`` None draws a fresh seed per sample (kept in metadata);
    turn ``k`` samples with ``seed + k``. ``stop`` strings must be single tokens: the fleet's
    engines stop on token ids."""

    model: str = "reference-lm"
    max_turns: int = 4
    max_new_tokens: int = 256
    context_limit: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    append_eos_after_stop: bool = True
    return_routed_experts: bool = False
    tools: Sequence[Any] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    step_timeout: float | None = None
    # The session's staleness bound (docs/async_rl.md): a turn answering stale_policy ends the
    # sample as aborted (the trainer drops it), with the error in metadata.
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns <= 0:
            raise ValueError(f"max_turns must be a positive integer, got {self.max_turns!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be non-negative, got {self.max_new_tokens}")
        if self.context_limit is not None and self.context_limit < 0:
            raise ValueError(f"context_limit must be non-negative, got {self.context_limit}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.return_routed_experts and self.append_eos_after_stop and self.stop:
            raise ValueError("routed experts cannot cover an EOS the driver appends after a stop string; "
                             "set append_eos_after_stop=False or drop the stop strings")

    @classmethod
    def from_sampling_params(cls, params: Mapping[str, Any], **fields: Any) -> MultiTurnConfig:
        """From vime/sglang-style sampling params (``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k`` (-1 = off), ``stop``, ``stop_token_ids``, ``seed``); ``fields`` win."""
        numbers = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
        values = {key: params[key] for key in numbers if params.get(key) is not None}
        values.update({key: params[key] for key in ("stop", "stop_token_ids") if params.get(key)})
        return cls(**{**values, **fields})


@dataclass
class RolloutSample:
    """The result of one rollout, shaped like a vime ``Sample``. ``tokens`` = prompt + response;
    ``loss_mask`` / ``rollout_log_probs`` cover the response; ``response`` decodes the generated
    tokens only; ``routed_experts`` is ``(len(tokens) - 1, layers, top_k)`` when asked for.
    ``weight_versions`` holds the policy version of each generated token, in order (the step's
    per-token ``weight_versions``): observation tokens and a driver-appended EOS have none, so its
    length is ``sum(loss_mask)``."""

    tokens: list[int]
    prompt_length: int
    session_id: str = ""
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    status: RolloutStatus = RolloutStatus.TRUNCATED
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)  # one per generated token (loss_mask 1)
    routed_experts: np.ndarray | None = None
    turns: int = 0
    multimodal_features: dict[str, Any] | None = None  # the prompt's render features (VLM prompts)

    def append(self, tokens: Sequence[int], log_probs: Sequence[float] | None = None) -> None:
        """Response tokens: generated ones with their log probs (trainable), others without."""
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"{len(log_probs)} log probs for {len(tokens)} tokens")
        self.tokens.extend(tokens)
        self.response_length += len(tokens)
        self.loss_mask.extend([0 if log_probs is None else 1] * len(tokens))
        self.rollout_log_probs.extend([0.0] * len(tokens) if log_probs is None else log_probs)


@dataclass(frozen=True)
class _Turn:
    tokens: list[int]
    log_probs: list[float]
    finish: str
    text: str
    versions: list[int] = field(default_factory=list)


def _parse_output(result: StepResult, tokenizer: ChatTokenizer) -> _Turn:
    output = result.output or {}
    finish = str(output.get("finish_reason"))
    if finish in ("abort", "cancelled"):
        return _Turn([], [], "abort", "")
    if finish not in ("stop", "length"):
        raise ValueError(f"unsupported finish_reason {finish!r}")
    tokens, log_probs = output.get("token_ids"), output.get("logprobs")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise TypeError("output.token_ids must be a list of integers")
    if not isinstance(log_probs, list) or len(log_probs) != len(tokens):
        raise ValueError(f"token/logprob count mismatch: {len(tokens)} tokens, "
                         f"{len(log_probs) if isinstance(log_probs, list) else log_probs!r} logprobs")
    text = tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""
    # An engine that reports no per-token versions ran the step on one version: the result's.
    versions = output.get("weight_versions", [result.policy_version] * len(tokens))
    if not isinstance(versions, list) or len(versions) != len(tokens) or not all(type(v) is int for v in versions):
        raise ValueError(f"output.weight_versions must be one integer per token ({len(tokens)})")
    return _Turn(tokens, [float(x) for x in log_probs], finish, text, versions)


class Rollout:
    """The turn loop of one sample on one session. A fork's branch starts at ``first_step`` with
    ``sent`` tokens (the prompt) already in the worker's context; ``stopped`` (the group driver's
    cancel) ends the loop before its next turn."""

    def __init__(self, session: Session, config: MultiTurnConfig, tokenizer: ChatTokenizer,
                 sample: RolloutSample, seed: int, *, first_step: int = 0, sent: int = 0,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self.session, self.config, self.tokenizer, self.sample, self.seed = session, config, tokenizer, sample, seed
        self.first_step, self.stopped = first_step, stopped
        self.sent = sent  # tokens of sample.tokens the worker's context holds
        self.generated: list[int] = []
        self.routed: list[np.ndarray] = []
        self.stop_ids = [*config.stop_token_ids, *stop_ids(tokenizer, config.stop)]
        budget = config.max_new_tokens
        if config.context_limit is not None:
            budget = min(budget, max(0, config.context_limit - sample.prompt_length))
        self.budget = budget

    @property
    def remaining(self) -> int:
        return self.budget - self.sample.response_length

    def finish(self, status: RolloutStatus, reason: str | None = None, **details: Any) -> bool:
        self.sample.status = status
        if reason is not None:
            self.sample.metadata["multiturn_truncation"] = {"reason": reason, **details}
        return True

    async def run(self, env: Environment) -> None:
        for turn_index in range(self.config.max_turns):
            if self.remaining <= 0:
                self.finish(RolloutStatus.TRUNCATED, "insufficient_budget", remaining_budget=self.remaining)
                return
            if self.stopped():
                self.sample.metadata["cancelled"] = True
                self.finish(RolloutStatus.ABORTED)
                return
            turn = await self._generate(turn_index)
            if turn is None:
                return
            if turn.finish == "abort":
                self.finish(RolloutStatus.ABORTED)
                return
            if self._append_generated(turn):
                return
            if turn.finish == "length":
                self.finish(RolloutStatus.TRUNCATED, "length", remaining_budget=self.remaining)
                return
            if self._advance_environment(env, turn, turn_index):
                return

    async def _generate(self, turn_index: int) -> _Turn | None:
        cfg = self.config
        step_id = self.first_step + turn_index
        sampling = {"max_tokens": self.remaining, "temperature": cfg.temperature, "top_p": cfg.top_p,
                    "top_k": cfg.top_k, "seed": (self.seed + turn_index) % _SEED_SPACE,
                    "stop_token_ids": self.stop_ids}
        # The prompt's images go with step 0 only: the worker keeps them in the session's context.
        features = self.sample.multimodal_features if step_id == 0 else None
        extra = {} if features is None else {"multimodal": features}
        result = await self.session.step(step_id, token_ids=self.sample.tokens[self.sent:], sampling=sampling,
                                         return_routed_experts=cfg.return_routed_experts, timeout=cfg.step_timeout,
                                         **extra)
        self.sample.turns = turn_index + 1
        if not result.ok:
            error = result.error
            self.sample.metadata["error"] = {"code": error.code.value if error else "unknown",
                                             "message": error.message if error else "", "step_id": step_id}
            code = error.code if error is not None else None
            if code is ErrorCode.CANCELLED:
                self.sample.metadata["cancelled"] = True
            # Aborted samples are the trainer's to drop or recycle (vime's ABORTED); failed ones are errors.
            aborted = code in (ErrorCode.STALE_POLICY, ErrorCode.CANCELLED)
            self.finish(RolloutStatus.ABORTED if aborted else RolloutStatus.FAILED)
            return None
        turn = _parse_output(result, self.tokenizer)
        self.sample.metadata.setdefault("finish_reasons", []).append(turn.finish)
        if turn.finish != "abort":
            self.sent = len(self.sample.tokens) + len(turn.tokens)
            self._collect_routed(result)
        return turn

    def _collect_routed(self, result: StepResult) -> None:
        if not self.config.return_routed_experts:
            return
        routed = (result.output or {}).get("routed_experts")
        if not isinstance(routed, np.ndarray) or routed.ndim != 3:
            raise ValueError("the step result has no routed_experts array (rows, layers, top_k)")
        self.routed.append(routed)
        rows = sum(chunk.shape[0] for chunk in self.routed)
        if rows != self.sent - 1:
            raise ValueError(f"routed experts cover {rows} positions; the context has {self.sent} tokens")

    def _append_generated(self, turn: _Turn) -> bool:
        if len(turn.tokens) > self.remaining:
            raise ValueError(f"the engine generated {len(turn.tokens)} tokens; {self.remaining} were asked for")
        self.sample.append(turn.tokens, turn.log_probs)
        self.sample.weight_versions.extend(turn.versions)
        self.generated.extend(turn.tokens)
        eos = eos_id(self.tokenizer)
        needs_eos = (self.config.append_eos_after_stop and turn.finish == "stop" and bool(self.config.stop)
                     and turn.text.endswith(self.config.stop) and not (turn.tokens and turn.tokens[-1] == eos))
        if not needs_eos:
            return False
        if self.remaining <= 0:
            return self.finish(RolloutStatus.TRUNCATED, "insufficient_budget_for_stop_eos",
                               remaining_budget=self.remaining)
        self.sample.append([eos])  # not trainable; reaches the worker with the next step
        return False

    def _advance_environment(self, env: Environment, turn: _Turn, turn_index: int) -> bool:
        observation, done, info = env.step(turn.text)
        if isinstance(info, Mapping):
            self.sample.metadata["env_info"] = dict(info)
        if done:
            return self.finish(RolloutStatus.COMPLETED)
        if turn_index + 1 >= self.config.max_turns:
            return self.finish(RolloutStatus.TRUNCATED, "max_turns", max_turns=self.config.max_turns)
        message = env.format_observation(observation)
        check_text_message(message)
        ids = observation_token_ids(self.tokenizer, message, self.sample.tokens, tools=self.config.tools,
                                    template_kwargs=self.config.chat_template_kwargs)
        if len(ids) < self.remaining:
            self.sample.append(ids)
            return False
        return self.finish(RolloutStatus.TRUNCATED, "insufficient_budget_for_next_turn",
                           observation_tokens=len(ids), remaining_budget=self.remaining)

    def finalize(self) -> RolloutSample:
        sample = self.sample
        sample.response = self.tokenizer.decode(self.generated, skip_special_tokens=False)
        if self.config.return_routed_experts and self.routed:
            experts = np.concatenate(self.routed, axis=0)
            if experts.shape[0] != len(sample.tokens) - 1:
                raise ValueError(f"routed experts have {experts.shape[0]} rows for {len(sample.tokens)} tokens")
            sample.routed_experts = experts
        return sample


async def run_multiturn(fleet: FleetClient, env: Environment, messages: Sequence[Mapping[str, Any]],
                        config: MultiTurnConfig | None = None, *, tokenizer: ChatTokenizer | None = None,
                        session_id: str | None = None, renderer: ChatRenderer | None = None) -> RolloutSample:
    """Roll out one sample: ``env.reset()``, the prompt as step 0, then model turn / env turn until
    the env is done or a budget ends. ``env.close()`` and the session's close always run.

    ``renderer`` (e.g. ``broker.rollouts.render.ServerRenderer``) renders the prompt instead of the
    tokenizer; prompts with images need one, and their features go with step 0. Observations of
    later turns are text, tokenized here.

    A failed step ends the sample with status ``failed`` (``metadata["error"]``; ``aborted`` for
    ``stale_policy``, past ``config.max_staleness``); bad
    configuration, a malformed engine answer or a session that cannot be created raise.
    """
    config = config or MultiTurnConfig()
    tok: ChatTokenizer = tokenizer if tokenizer is not None else ReferenceTokenizer()
    active: BaseException | None = None
    try:
        env.reset()
        prompt, features = await render_prompt(messages, config, tok, renderer)
        return await _run_session(fleet, env, prompt, config, tok, session_id, features)
    except BaseException as error:
        active = error
        raise
    finally:
        try:
            env.close()
        except BaseException as close_error:
            if active is None:
                raise
            raise active from close_error


async def render_prompt(messages: Sequence[Mapping[str, Any]], config: MultiTurnConfig, tokenizer: ChatTokenizer,
                        renderer: ChatRenderer | None = None) -> tuple[list[int], dict[str, Any] | None]:
    """The prompt's token ids (and its render features with a renderer), as step 0 carries them."""
    features: dict[str, Any] | None = None
    if renderer is not None:
        rendered = await renderer.render(list(messages), tools=config.tools,
                                         chat_template_kwargs=config.chat_template_kwargs)
        prompt, features = list(rendered.token_ids), rendered.features
    elif has_images(messages):
        raise ValueError("a prompt with images needs a renderer (broker.rollouts.render.ServerRenderer)")
    else:
        prompt = template_ids(tokenizer.apply_chat_template(
            list(messages), tools=config.tools, tokenize=True, add_generation_prompt=True,
            **dict(config.chat_template_kwargs)))
    if not prompt:
        raise ValueError("the rendered prompt is empty")
    return prompt, features


async def _run_session(fleet: FleetClient, env: Environment, prompt: list[int], config: MultiTurnConfig,
                       tokenizer: ChatTokenizer, session_id: str | None,
                       features: dict[str, Any] | None = None) -> RolloutSample:
    seed = config.seed if config.seed is not None else draw_seed()
    session = await fleet.create_session(config.model, "tokens", session_id=session_id,
                                         max_staleness=config.max_staleness)
    sample = RolloutSample(tokens=list(prompt), prompt_length=len(prompt), session_id=session.session_id,
                           metadata={"fleet_session_id": session.session_id, "sampling_seed": seed},
                           multimodal_features=features)
    try:
        rollout = Rollout(session, config, tokenizer, sample, seed)
        await rollout.run(env)
        return rollout.finalize()
    finally:
        with contextlib.suppress(FleetError, RedisError, OSError):
            await session.close()
