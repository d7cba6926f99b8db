"""The pieces of the AReaL adapter that need no fleet: an AReaL ``GenerationHyperparameters`` as
the fleet's token-step ``sampling``, a step result as the fields of AReaL's ``ModelResponse``, and
the index of open conversations that lets a multi-turn workflow's next request continue the fleet
session holding its context (``broker/integrations/areal.py`` puts them together)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.client import Session
from schemas.errors import InvalidRequestError
from schemas.messages import StepResult

# AReaL's "no top-k filter" default (GenerationHyperparameters.top_k = int(1e8)); the fleet's is 0.
_AREAL_TOP_K_OFF = int(1e8)
# finish_reason of a fleet token step -> AReaL's stop_reason. A cancelled step ("abort") is AReaL's
# "abort"; the fleet finishes an interrupted step itself (a weight update continues it on the new
# weights, docs/async_rl.md), so no other reason reaches the trainer.
_STOP_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort"}


def fleet_sampling(gconfig: Any, input_len: int, tokenizer: Any = None) -> dict[str, Any]:
    """AReaL's ``gconfig`` for a request of ``input_len`` prompt tokens as the fleet's ``sampling``.

    ``max_tokens`` is ``min(max_tokens - input_len, max_new_tokens)`` as AReaL's own engines
    compute it; ``greedy`` is temperature 0; ``stop`` strings must each be one token of
    ``tokenizer`` (the fleet's engines stop on token ids). A setting the fleet cannot honour
    (``ignore_eos``, ``min_new_tokens``, ``frequency_penalty``, beam search) raises
    InvalidRequestError, never silently changes the samples."""
    if getattr(gconfig, "ignore_eos", False):
        raise InvalidRequestError("gconfig.ignore_eos is not supported by the fleet")
    for name, neutral in (("min_new_tokens", 0), ("frequency_penalty", 0.0), ("use_beam_search", False)):
        if getattr(gconfig, name, neutral) != neutral:
            raise InvalidRequestError(f"gconfig.{name} = {getattr(gconfig, name)!r} is not supported by the fleet")
    max_new = min(int(gconfig.max_tokens) - input_len, int(gconfig.max_new_tokens))
    if max_new <= 0:
        raise InvalidRequestError(f"no room to generate: max_tokens={gconfig.max_tokens}, prompt of {input_len} "
                                  f"tokens, max_new_tokens={gconfig.max_new_tokens}")
    top_k = int(gconfig.top_k)
    stops = [int(t) for t in gconfig.stop_token_ids or ()]
    stops += [t for t in _stop_string_ids(gconfig.stop, tokenizer) if t not in stops]
    return {"max_tokens": max_new, "temperature": 0.0 if gconfig.greedy else float(gconfig.temperature),
            "top_p": float(gconfig.top_p), "top_k": 0 if top_k >= _AREAL_TOP_K_OFF or top_k < 0 else top_k,
            "stop_token_ids": stops}


def _stop_string_ids(stop: Sequence[str] | None, tokenizer: Any) -> list[int]:
    if not stop:
        return []
    if tokenizer is None:
        raise InvalidRequestError("gconfig.stop needs the request's tokenizer (stop strings become token ids)")
    ids = []
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise InvalidRequestError(f"stop string {text!r} is {len(encoded)} tokens; the fleet stops on single "
                                      "tokens (use gconfig.stop_token_ids)")
        ids.append(int(encoded[0]))
    return ids


@dataclass(frozen=True)
class Generated:
    """One step's tokens as AReaL reads them: ``versions`` is the policy version of each token (the
    step's per-token ``weight_versions``: a step continued across a weight update mixes two)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str


def generated(result: StepResult) -> Generated:
    """The output of a successful token step, checked: one log prob and one version per token."""
    output = dict(result.output or {})
    tokens = [int(t) for t in output.get("token_ids") or []]
    logprobs = [float(x) for x in output.get("logprobs") or []]
    versions = [int(v) for v in output.get("weight_versions", [result.policy_version] * len(tokens))]
    if not len(tokens) == len(logprobs) == len(versions):
        raise InvalidRequestError(f"step result of session {result.session_id}: {len(tokens)} tokens, "
                                  f"{len(logprobs)} log probs, {len(versions)} versions")
    finish = str(output.get("finish_reason"))
    return Generated(tokens, logprobs, versions, _STOP_REASONS.get(finish, "stop"))


@dataclass(eq=False)
class Conversation:
    """One fleet session and the tokens its worker holds (``context``); ``next_step`` is the step id
    its next request takes."""

    session: Session
    context: list[int] = field(default_factory=list)
    next_step: int = 0


class ConversationIndex:
    """The open conversations of one episode, by context. A request whose ``input_ids`` extend a
    conversation's context continues it (only the new tokens travel); a claimed conversation leaves
    the index until its step is done, so two concurrent requests never share one. Equal contexts
    (greedy samples of one prompt) are kept side by side: either serves, their workers hold the
    same tokens."""

    def __init__(self) -> None:
        self._by_context: dict[tuple[int, ...], list[Conversation]] = {}
        self._open: dict[int, Conversation] = {}  # every open conversation, oldest first

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Conversation]:
        return iter(list(self._open.values()))

    def claim(self, input_ids: Sequence[int]) -> Conversation | None:
        """The open conversation with the longest context that ``input_ids`` strictly extend."""
        lengths = sorted({len(c.context) for c in self._open.values() if 0 < len(c.context) < len(input_ids)},
                         reverse=True)
        for length in lengths:
            waiting = self._by_context.get(tuple(input_ids[:length]))
            if waiting:
                conversation = waiting.pop()
                if not waiting:
                    del self._by_context[tuple(input_ids[:length])]
                return conversation
        return None

    def add(self, conversation: Conversation) -> None:
        """Track a new (claimed) conversation."""
        self._open[id(conversation)] = conversation

    def release(self, conversation: Conversation) -> None:
        """A claimed conversation's step is done: it may be continued from its new context."""
        self._by_context.setdefault(tuple(conversation.context), []).append(conversation)
        self._open[id(conversation)] = self._open.pop(id(conversation), conversation)  # now the newest

    def forget(self, conversation: Conversation) -> None:
        """Stop tracking a (claimed) conversation, e.g. one whose step failed."""
        self._open.pop(id(conversation), None)

    def evict_oldest(self) -> Conversation | None:
        """The least recently used conversation not in flight, removed (None when all are)."""
        for conversation in self._open.values():
            waiting = self._by_context.get(tuple(conversation.context), [])
            if conversation in waiting:
                waiting.remove(conversation)
                if not waiting:
                    del self._by_context[tuple(conversation.context)]
                del self._open[id(conversation)]
                return conversation
        return None

    def drain(self) -> Iterator[Conversation]:
        """Every conversation, removed (the episode is over)."""
        conversations = list(self._open.values())
        self._open.clear()
        self._by_context.clear()
        yield from conversations
