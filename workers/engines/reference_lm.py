"""A small decoder-only MoE transformer with a real per-session KV cache: the CPU stand-in for an
LLM served by vLLM. Byte-level vocabulary from ``schemas.reference_tokenizer``.

Batch invariance: all sessions' new rows go through the dense layers together, using only
row-independent ops (``torch_ops.linear`` / ``rms_norm`` / ``pointwise``); attention runs per
session against that session's own cache, so its shapes never depend on the batch; sampling runs
per request with a generator seeded by the request (``sampling.seed``, or a fixed default).

Cache invariant: after every step, the cache holds K/V for every context token except the last
one. The next step feeds that pending token first (before the step's own tokens), so the routed
experts of all steps of a session cover ``len(context) - 1`` positions in total.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from schemas.errors import InvalidRequestError
from schemas.messages import StepInput, TokenStep
from schemas.reference_tokenizer import EOS_ID, VOCAB_SIZE
from workers.engines import torch_ops
from workers.engines.partial import PartialAbort
from workers.engines.reference_sampling import process_logits, stop_string_hit, top_logprobs

_SPAN = 64  # keys are attended over in spans of this many (zero-padded; see _attend)
_ATTENTION_CHUNK_ELEMENTS = 1 << 22  # elements per temporary product tensor in _attend
KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (K, V): (tokens, heads, head_dim)


@dataclass(frozen=True)
class ReferenceLMConfig:
    """Architecture of the reference LM (weights come from the model seed)."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_hidden: int = 256
    num_experts: int = 4
    top_k: int = 2
    max_context: int = 4096
    eos_token_id: int = EOS_ID
    default_sampling_seed: int = 0  # used when a request's sampling.seed is None
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError("d_model must be divisible by num_heads")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError("need 0 < top_k <= num_experts")
        if min(self.vocab_size, self.num_layers, self.mlp_hidden, self.max_context) <= 0:
            raise ValueError("vocab_size, num_layers, mlp_hidden and max_context must be positive")


@dataclass(frozen=True)
class LMSessionState:
    """One session's context: all tokens, and K/V for all of them but the last."""

    tokens: tuple[int, ...] = ()
    cache: KVCache = ()

    @property
    def fed(self) -> int:
        return int(self.cache[0][0].shape[0]) if self.cache else 0

    @property
    def context_length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class LMStepResult:
    """What one token step produced, and the session state to store if it is kept."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: np.ndarray | None
    state: LMSessionState
    extra: dict[str, Any] = field(default_factory=dict)  # stop_reason, top_logprobs: only when asked for

    @property
    def context_length(self) -> int:
        return self.state.context_length

    def output(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                               "finish_reason": self.finish_reason}
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        return {**out, **self.extra}


@dataclass
class LMJob:
    """A validated request being worked on. Holds its own copies; the stored state is untouched."""

    step: TokenStep
    tokens: list[int]
    cache: KVCache
    budget: int
    stops: frozenset[int]
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fed(self) -> int:
        return int(self.cache[0][0].shape[0]) if self.cache else 0


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    w_qkv: torch.Tensor  # (3 * d_model, d_model)
    w_o: torch.Tensor
    mlp_norm: torch.Tensor
    w_router: torch.Tensor  # (experts, d_model)
    w_in: torch.Tensor  # (experts, hidden, d_model)
    w_out: torch.Tensor  # (experts, d_model, hidden)


class ReferenceLanguageModel:
    """Weights plus the batched prefill/decode loop. Session state is passed in and returned."""

    def __init__(self, config: ReferenceLMConfig | None = None, *, seed: int = 0,
                 device: str = "cpu") -> None:
        self.config = cfg = config or ReferenceLMConfig()
        self.device = torch.device(device)
        gen = torch_ops.seeded_generator(seed)
        d, hidden, experts = cfg.d_model, cfg.mlp_hidden, cfg.num_experts

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        def ones() -> torch.Tensor:
            return torch.ones(d, device=self.device)

        self.embed = rand(cfg.vocab_size, d, scale=1.0)
        self.pos_embed = rand(cfg.max_context, d, scale=0.5)
        self.layers = [
            _Layer(attn_norm=ones(), w_qkv=rand(3 * d, d, scale=1 / math.sqrt(d)),
                   w_o=rand(d, d, scale=0.5 / math.sqrt(d)), mlp_norm=ones(),
                   w_router=rand(experts, d, scale=1 / math.sqrt(d)),
                   w_in=rand(experts, hidden, d, scale=1 / math.sqrt(d)),
                   w_out=rand(experts, d, hidden, scale=0.5 / math.sqrt(hidden)))
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = ones()
        self.w_head = rand(cfg.vocab_size, d, scale=2.0 / math.sqrt(d))

    # ------------------------------------------------------------------ validation

    def prepare(self, state: LMSessionState | None, step: StepInput) -> LMJob:
        """Validate one request against its session; raises InvalidRequestError, mutates nothing."""
        cfg = self.config
        if not isinstance(step, TokenStep):
            raise InvalidRequestError(f"the language model takes token steps, got {type(step).__name__}")
        state = state or LMSessionState()
        if not isinstance(state, LMSessionState):
            raise InvalidRequestError("session state does not belong to this language model")
        if step.multimodal:
            raise InvalidRequestError("reference-lm is text only: multimodal inputs are not supported")
        bad = [t for t in step.token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        new_length = len(state.tokens) + len(step.token_ids)
        if new_length > cfg.max_context:
            raise InvalidRequestError(
                f"context would hold {new_length} tokens; max_context is {cfg.max_context}")
        sampling = step.sampling
        if sampling.max_tokens < 0 or not 0.0 <= sampling.top_p <= 1.0 \
                or not (math.isfinite(sampling.temperature) and sampling.temperature >= 0.0):
            raise InvalidRequestError("sampling needs max_tokens >= 0, temperature >= 0, 0 <= top_p <= 1")
        budget = min(sampling.max_tokens, cfg.max_context - new_length)
        if budget > 0 and new_length == 0:
            raise InvalidRequestError("nothing to generate from: the context is empty")
        seed = cfg.default_sampling_seed if sampling.seed is None else sampling.seed
        if not 0 <= seed < 1 << 64:
            raise InvalidRequestError(f"sampling.seed must be in [0, 2**64), got {seed}")
        generator = torch_ops.seeded_generator(seed) if sampling.temperature > 0 else None
        return LMJob(step=step, tokens=[*state.tokens, *step.token_ids], cache=state.cache, budget=budget,
                     stops=frozenset((cfg.eos_token_id, *sampling.stop_token_ids)), generator=generator)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def run(self, jobs: Sequence[LMJob], should_stop: Callable[[], bool] | None = None,
            stop_job: Callable[[LMJob], bool] | None = None) -> list[LMStepResult | PartialAbort]:
        """Prefill every job, then decode all of them in lockstep until each is done. ``should_stop``
        is asked before every decode step; when it says so, each job still generating answers
        ``PartialAbort`` with what it generated so far (job caches are new tensors, so the
        sessions' states are untouched) and each finished job its result. ``stop_job`` stops one
        job (a cancelled session): it leaves the lockstep with finish_reason ``STOPPED`` and the
        others go on unchanged (batch invariance)."""
        feeds = [job.tokens[job.fed : len(job.tokens) - (0 if job.budget > 0 else 1)] for job in jobs]
        for job, logits in zip(jobs, self._forward(jobs, feeds), strict=True):
            if job.budget > 0 and logits is not None:
                self._sample(job, logits)
            else:
                job.finish_reason = "length"
        active = _still_running(jobs, stop_job)
        while active:
            if should_stop is not None and should_stop():
                return [self._result(job) if job.finish_reason is not None
                        else PartialAbort("aborted for a weight update", job.generated, job.logprobs) for job in jobs]
            outputs = self._forward(active, [[job.tokens[-1]] for job in active])
            for job, logits in zip(active, outputs, strict=True):
                assert logits is not None
                self._sample(job, logits)
            active = _still_running(active, stop_job)
        return [self._result(job) for job in jobs]

    def generate(self, items: Sequence[tuple[LMSessionState | None, TokenStep]]) -> list[LMStepResult]:
        """``prepare`` + ``run``; the first invalid request raises before anything runs."""
        results = self.run([self.prepare(state, step) for state, step in items])
        return [r for r in results if isinstance(r, LMStepResult)]  # nothing stops a run without should_stop

    def _result(self, job: LMJob) -> LMStepResult:
        cfg = self.config
        routed: np.ndarray | None = None
        if job.step.return_routed_experts:
            rows = torch.cat(job.routed) if job.routed else torch.zeros((0, cfg.num_layers, cfg.top_k))
            routed = rows.to("cpu", torch.int16).numpy()
        return LMStepResult(token_ids=list(job.generated), logprobs=list(job.logprobs),
                            finish_reason=job.finish_reason or "length", routed_experts=routed,
                            state=LMSessionState(tokens=tuple(job.tokens), cache=job.cache), extra=dict(job.extra))

    def _sample(self, job: LMJob, logits: torch.Tensor) -> None:
        """Pick the next token of ``job`` from its last-position logits (float32, CPU, (vocab,))."""
        sampling = job.step.sampling
        logits = process_logits(logits, sampling, job.tokens, job.generated, job.stops)
        if job.generator is None:
            token = int(torch.argmax(logits))
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            scaled = logits / sampling.temperature
            logprobs = torch.log_softmax(scaled, dim=-1)
            token = _draw(scaled, sampling.top_k, sampling.top_p, job.generator)
        job.generated.append(token)
        job.tokens.append(token)
        job.logprobs.append(float(logprobs[token]))
        if sampling.logprobs:
            job.extra.setdefault("top_logprobs", []).append(top_logprobs(logprobs, sampling.logprobs))
        hit = stop_string_hit(job.generated, sampling.stop) if len(job.generated) >= sampling.min_tokens else None
        if token in job.stops or hit is not None:
            job.finish_reason = "stop"
            if hit is not None:
                job.extra["stop_reason"] = hit
        elif len(job.generated) >= job.budget:
            job.finish_reason = "length"

    # ------------------------------------------------------------------ forward pass

    def _forward(self, jobs: Sequence[LMJob], feeds: Sequence[Sequence[int]]) -> list[torch.Tensor | None]:
        """Feed each job its tokens (all jobs' rows in one pass); update job caches and routed
        experts; return each job's last-position logits (None where the feed was empty)."""
        live = [(job, list(feed)) for job, feed in zip(jobs, feeds, strict=True) if feed]
        if not live:
            return [None] * len(jobs)
        starts = [job.fed for job, _ in live]
        counts = [len(feed) for _, feed in live]
        ids = torch.tensor([t for _, feed in live for t in feed], device=self.device)
        positions = torch.tensor([p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)],
                                 device=self.device)
        x = self.embed[ids] + self.pos_embed[positions]
        caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in live]
        routed: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, index, x, [job for job, _ in live], starts, counts, caches)
            mlp_out, experts = self._moe(layer, torch_ops.rms_norm(x, layer.mlp_norm, self.config.norm_eps))
            x = x + mlp_out
            routed.append(experts)
        last = torch.tensor(np.cumsum(counts) - 1, device=self.device)
        logits = torch_ops.linear(torch_ops.rms_norm(x[last], self.final_norm, self.config.norm_eps),
                                  self.w_head).to("cpu")
        per_row = torch.split(torch.stack(routed, dim=1), counts)
        by_job: dict[int, torch.Tensor] = {}
        for i, (job, _) in enumerate(live):
            job.cache = tuple(caches[i])
            job.routed.append(per_row[i])
            by_job[id(job)] = logits[i].clone()
        return [by_job.get(id(job)) for job in jobs]

    def _attention(self, layer: _Layer, index: int, x: torch.Tensor, jobs: Sequence[LMJob],
                   starts: Sequence[int], counts: Sequence[int],
                   caches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        cfg = self.config
        heads, head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
        qkv = torch_ops.linear(torch_ops.rms_norm(x, layer.attn_norm, cfg.norm_eps), layer.w_qkv)
        q, k, v = (part.reshape(-1, heads, head_dim) for part in torch.split(qkv, cfg.d_model, dim=-1))
        outs: list[torch.Tensor] = []
        offset = 0
        for i, (job, start, count) in enumerate(zip(jobs, starts, counts, strict=True)):
            rows = slice(offset, offset + count)
            offset += count
            if job.cache:
                past_k, past_v = job.cache[index]
            else:
                past_k = past_v = x.new_zeros((0, heads, head_dim))
            keys, values = torch.cat([past_k, k[rows]]), torch.cat([past_v, v[rows]])
            caches[i].append((keys, values))
            outs.append(_attend(q[rows], keys, values, start))
        return torch_ops.linear(torch.cat(outs), layer.w_o)

    def _moe(self, layer: _Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed mixture of SiLU experts; each row is computed on its own."""
        top = torch.topk(torch_ops.linear(h, layer.w_router), self.config.top_k, dim=-1)
        weights = torch_ops.softmax(top.values)
        out = torch.zeros_like(h)
        for j in range(self.config.top_k):
            choice = top.indices[:, j]
            contribution = torch.zeros_like(h)
            for expert in range(self.config.num_experts):
                rows = (choice == expert).nonzero().squeeze(-1)
                if rows.numel():
                    hidden = torch_ops.pointwise(torch.nn.functional.silu,
                                                 torch_ops.linear(h[rows], layer.w_in[expert]))
                    contribution[rows] = torch_ops.linear(hidden, layer.w_out[expert])
            out = out + weights[:, j : j + 1] * contribution
        return out, top.indices


STOPPED = "stopped"  # finish_reason of a job ``stop_job`` stopped: never a result the trainer sees


def _still_running(jobs: Sequence[LMJob], stop_job: Callable[[LMJob], bool] | None) -> list[LMJob]:
    """The jobs still decoding; those ``stop_job`` names stop here."""
    for job in jobs:
        if job.finish_reason is None and stop_job is not None and stop_job(job):
            job.finish_reason = STOPPED
    return [job for job in jobs if job.finish_reason is None]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of ``q`` (n, heads, head_dim), at positions ``start..start+n-1``, over
    ``keys``/``values`` (start + n, heads, head_dim) of one session.

    A query at position ``p`` attends over a span of keys whose length depends on ``p`` alone: the
    keys ``0..p``, zero-padded to the next multiple of ``_SPAN`` (masked: their weights are exactly
    0). Scores are elementwise products summed over ``head_dim``; the softmax and the weighted sum
    of values reduce rows of that span. So a position's bits are the same whether it is fed in a
    prefill, as one decode step, or in one prefill of a whole recorded conversation (the
    one-prefill context rebuild relies on that). A matmul over a chunk of queries would let BLAS
    pick its kernel by the chunk's size. Queries whose spans are equal run together.
    """
    n, heads, head_dim = q.shape
    total = keys.shape[0]
    padded = -(-total // _SPAN) * _SPAN
    kh = keys.new_zeros((heads, padded, head_dim))
    kh[:, :total] = keys.permute(1, 0, 2)
    vt = values.new_zeros((heads, head_dim, padded))
    vt[:, :, :total] = values.permute(1, 2, 0)
    qh = q.permute(1, 0, 2)  # (heads, n, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    outs: list[torch.Tensor] = []
    first = 0
    while first < n:
        span = (start + first) // _SPAN * _SPAN + _SPAN  # every query before the span's end has it
        rows = max(1, min(span - start - first, _ATTENTION_CHUNK_ELEMENTS // (heads * span * head_dim)))
        last = min(n, first + rows)
        positions = torch.arange(start + first, start + last, device=q.device)
        scores = (qh[:, first:last, None, :] * kh[:, None, :span]).sum(-1) * scale  # (heads, rows, span)
        masked = torch.arange(span, device=q.device)[None, :] > positions[:, None]
        probs = torch_ops.softmax(scores.masked_fill(masked, -math.inf))
        outs.append((probs[:, :, None, :] * vt[:, None, :, :span]).sum(-1))  # (heads, rows, head_dim)
        first = last
    return torch.cat(outs, dim=1).permute(1, 0, 2).reshape(n, heads * head_dim)


def _draw(scaled: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """Sample from ``softmax(scaled)`` after top-k / top-p filtering, by inverse CDF (float64)."""
    work = scaled.to(torch.float64)
    if 0 < top_k < work.shape[0]:
        kth = torch.topk(work, top_k).values[-1]
        work = work.masked_fill(work < kth, -math.inf)
    probs = torch.softmax(work, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    cdf = torch.cumsum(probs, dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), work.shape[0] - 1)
