"""Token step input: the ids appended to a session's context and how to sample the next ones."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.records import quick_init
from schemas.wire_fields import as_extra, as_int, as_list, as_mapping, as_number, check_fields, or_default

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs


@quick_init
@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one token step. ``top_k <= 0`` and ``top_p == 1`` disable those filters;
    ``temperature == 0`` is greedy. ``seed`` None means the engine's fixed default seed.

    As vLLM's: ``stop`` strings end the step when the detokenized output contains one (the token
    that completes it is kept); ``logprobs`` k > 0 also returns the k most likely tokens of every
    position; ``presence_penalty`` / ``frequency_penalty`` (over this step's output) and
    ``repetition_penalty`` (over the whole context) reshape the logits; ``min_tokens`` keeps EOS
    and the stop tokens from ending the step earlier."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    @classmethod
    def from_wire(cls, data: Any) -> SamplingParams:
        data = as_mapping(or_default(data, {}), "sampling")
        check_fields(data, _SAMPLING_FIELDS, "sampling")
        seed = data.get("seed")
        stops = as_list(or_default(data.get("stop_token_ids"), ()), "sampling.stop_token_ids", "integers")
        params = cls(
            max_tokens=as_int(data.get("max_tokens", 16), "sampling.max_tokens", minimum=0),
            temperature=as_number(data.get("temperature", 1.0), "sampling.temperature", low=0.0, high=100.0),
            top_p=as_number(data.get("top_p", 1.0), "sampling.top_p", low=0.0, high=1.0),
            top_k=as_int(data.get("top_k", 0), "sampling.top_k"),
            seed=None if seed is None else as_int(seed, "sampling.seed", minimum=0),
            stop_token_ids=tuple(as_int(t, "sampling.stop_token_ids[]", minimum=0) for t in stops),
            **_extra_from_wire(data),
        )
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(
                f"sampling.min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})")
        return params

    def to_wire(self) -> dict[str, Any]:
        out = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids)}
        # The newer fields only when set, so a default step's wire form is what it always was.
        for name, default in _EXTRA.items():
            value = getattr(self, name)
            if value != default:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


_EXTRA: dict[str, Any] = {"stop": (), "logprobs": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                          "repetition_penalty": 1.0, "min_tokens": 0}
_SAMPLING_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", *_EXTRA})
_STEP_FIELDS = frozenset({"token_ids", "sampling", "return_routed_experts", "multimodal"})


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]  # vLLM takes one string or a list
    items = as_list(or_default(value, ()), "sampling.stop", "strings")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"sampling.stop has {len(items)} strings; limit is {MAX_STOP_STRINGS}")
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"sampling.stop must hold non-empty strings of at most {MAX_STOP_CHARS} characters")
    return tuple(items)


def _extra_from_wire(data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "stop": _stop_strings(data.get("stop")),
        "logprobs": as_int(or_default(data.get("logprobs"), 0), "sampling.logprobs", minimum=0,
                           maximum=MAX_TOP_LOGPROBS),
        "presence_penalty": as_number(data.get("presence_penalty", 0.0), "sampling.presence_penalty",
                                      low=-2.0, high=2.0),
        "frequency_penalty": as_number(data.get("frequency_penalty", 0.0), "sampling.frequency_penalty",
                                       low=-2.0, high=2.0),
        # vLLM needs > 0; the floor keeps logits / penalty finite.
        "repetition_penalty": as_number(data.get("repetition_penalty", 1.0), "sampling.repetition_penalty",
                                        low=0.01, high=100.0),
        "min_tokens": as_int(data.get("min_tokens", 0), "sampling.min_tokens", minimum=0),
    }


@quick_init
@dataclass(frozen=True)
class TokenStep:
    """Input of one token step: ids appended to the session's context, then a generation."""

    token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    multimodal: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> TokenStep:
        data = as_mapping(data, "token step")
        check_fields(data, _STEP_FIELDS, "token step")
        ids = data.get("token_ids")
        if isinstance(ids, np.ndarray):
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                raise InvalidRequestError("token_ids must be a 1-D integer array")
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError("token_ids must be a list of integers")
        if len(ids) > limits.max_token_ids:
            raise PayloadTooLargeError(f"{len(ids)} token ids; limit is {limits.max_token_ids}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError("token_ids must contain non-negative integers")
        flag = data.get("return_routed_experts", False)
        if not isinstance(flag, bool):
            raise InvalidRequestError("return_routed_experts must be a boolean")
        return cls(token_ids=tuple(ids), sampling=SamplingParams.from_wire(data.get("sampling")),
                   return_routed_experts=flag,
                   multimodal=as_extra(data.get("multimodal"), "multimodal"))

    def to_wire(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "sampling": self.sampling.to_wire(),
                "return_routed_experts": self.return_routed_experts, "multimodal": dict(self.multimodal)}
