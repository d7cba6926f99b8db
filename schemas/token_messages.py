"""Token step input: the ids appended to a session's context and how to sample the next ones."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.wire_fields import as_extra, as_int, as_list, as_mapping, as_number, check_fields, or_default


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one token step. ``top_k <= 0`` and ``top_p == 1`` disable those filters;
    ``temperature == 0`` is greedy. ``seed`` None means the engine's fixed default seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, data: Any) -> SamplingParams:
        data = as_mapping(or_default(data, {}), "sampling")
        check_fields(data, {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"},
                      "sampling")
        seed = data.get("seed")
        stops = as_list(or_default(data.get("stop_token_ids"), ()), "sampling.stop_token_ids", "integers")
        return cls(
            max_tokens=as_int(data.get("max_tokens", 16), "sampling.max_tokens", minimum=0),
            temperature=as_number(data.get("temperature", 1.0), "sampling.temperature", low=0.0, high=100.0),
            top_p=as_number(data.get("top_p", 1.0), "sampling.top_p", low=0.0, high=1.0),
            top_k=as_int(data.get("top_k", 0), "sampling.top_k"),
            seed=None if seed is None else as_int(seed, "sampling.seed", minimum=0),
            stop_token_ids=tuple(as_int(t, "sampling.stop_token_ids[]", minimum=0) for t in stops),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids)}


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
        check_fields(data, {"token_ids", "sampling", "return_routed_experts", "multimodal"}, "token step")
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
