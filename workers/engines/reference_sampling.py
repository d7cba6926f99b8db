"""The reference LM's logits processing, stop strings and top-k log probs, as vLLM defines them.

Everything here works on one request's row (a 1-D logits tensor and that request's own tokens), so
a request's output never depends on what else is in the batch (batch invariance). The order is
vLLM's: ``min_tokens`` masks the stop tokens, then the repetition penalty (over the whole context),
then the frequency and presence penalties (over this step's output), then temperature (the caller).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from schemas.reference_tokenizer import VOCAB_SIZE, ReferenceTokenizer
from schemas.token_messages import SamplingParams

_TOKENIZER = ReferenceTokenizer()
_MAX_BYTES_PER_CHAR = 4  # UTF-8: a stop string of n characters spans at most 4n byte tokens


def process_logits(logits: torch.Tensor, sampling: SamplingParams, context: Sequence[int],
                   generated: Sequence[int], stops: Collection[int]) -> torch.Tensor:
    """``logits`` (vocab,) with ``min_tokens`` and the penalties applied; a new tensor when any
    applies (the caller's is left as it was), else ``logits`` itself."""
    changes = (len(generated) < sampling.min_tokens, sampling.repetition_penalty != 1.0,
               sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0)
    if not any(changes):
        return logits
    out = logits.clone()
    vocab = out.shape[0]
    if changes[0]:
        blocked = [t for t in stops if 0 <= t < vocab]
        out[blocked] = -torch.inf
    if changes[1] and context:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(sorted(set(context)), dtype=torch.long)] = True
        penalty = sampling.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if changes[2] and generated:
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab).to(out.dtype)
        out = out - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(out.dtype)
    return out


def stop_string_hit(generated: Sequence[int], stop: Sequence[str]) -> str | None:
    """The stop string the newest token completes in the detokenized output, if any (vLLM: it
    looks for each stop string ending within the newly decoded characters)."""
    if not stop or not generated:
        return None
    # Ids past the reference vocabulary (a model configured wider) have no text: they match nothing.
    window = [t for t in generated[-_MAX_BYTES_PER_CHAR * max(len(s) for s in stop) - 1 :] if t < VOCAB_SIZE]
    text = _TOKENIZER.decode(window)
    new_chars = len(text) - len(_TOKENIZER.decode(window[:-1]))
    for candidate in stop:
        start = max(0, len(text) - new_chars - len(candidate) + 1)
        if candidate in text[start:]:
            return candidate
    return None


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[Any]]:
    """The ``k`` most likely tokens of one position as ``[token_id, logprob]`` pairs, most likely
    first; ties go to the lower id so the answer is deterministic."""
    order = sorted(range(logprobs.shape[0]), key=lambda t: (-float(logprobs[t]), t))[:k]
    return [[t, float(logprobs[t])] for t in order]
