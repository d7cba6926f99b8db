"""Partial generations: what a token step had generated when an aborting weight update stopped it.

An engine that can tell (the reference LM, the vLLM engines) raises ``PartialAbort`` instead of a
plain ``StepAborted``: it carries the tokens and log probabilities generated so far. A weight
update with ``in_flight="continue"`` keeps them and the worker continues the generation from them
on the new weights (``workers.executor.Continuation``); any other aborting update drops them and runs the
step again, whole. A step that had already finished is never aborted: it returns its output.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.errors import StepAborted


class PartialAbort(StepAborted):
    """A token step stopped part way; ``token_ids``/``logprobs``: what it had generated (the
    session's context is unchanged, as for any aborted step)."""

    def __init__(self, message: str, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        super().__init__(f"{message} ({len(token_ids)} tokens generated)")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} partial tokens with {len(logprobs)} logprobs")
        self.token_ids = [int(t) for t in token_ids]
        self.logprobs = [float(p) for p in logprobs]


def partial_of(exc: BaseException) -> tuple[list[int], list[float]]:
    """The tokens and logprobs an aborted step had generated (none when the engine cannot tell)."""
    if isinstance(exc, PartialAbort):
        return list(exc.token_ids), list(exc.logprobs)
    return [], []
