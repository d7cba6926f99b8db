"""Partial rollouts: a token step that spans weight updates, and the version of each of its tokens.

A weight update with ``in_flight="continue"`` aborts the running steps like ``abort`` does, but a
token step keeps what it generated before the abort (``PartialAbort``): after the update it runs
again with those tokens appended to its prompt and its ``max_tokens`` (and ``min_tokens``) reduced by their count, so
the generation continues on the new weights from where it stopped (vLLM's prefix cache finds the
context; only the kept tokens are prefilled). The result carries every token and log probability
of the step, and ``weight_versions``: the policy version of each generated token, e.g.
``[3, 3, 3, 4, 4]`` (vime's ``Sample.weight_versions``, per token). Every token step reports it,
all entries equal when the step ran on one version. The engine's context after the step is the
step's prompt plus all its tokens, exactly as for a step that was never aborted.

World-model steps have no partial output: under ``continue`` they run again, whole, as under
``abort``. So does a token step the engine stopped without telling what it had generated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from schemas.messages import TokenStep
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.partial import partial_of

VERSIONS_KEY = "weight_versions"


class Continuation:
    """One step's runs across aborting weight updates: the tokens kept so far and their versions."""

    def __init__(self, request: EngineRequest) -> None:
        self.original = request
        self.request = request  # what the engine runs next
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    @property
    def kept(self) -> int:
        return len(self.token_ids)

    def aborted(self, exc: BaseException, version: int, *, keep: bool) -> int:
        """The step was aborted while it ran on ``version``. ``keep``: continue from what it
        generated (a ``continue`` update), else run it again, whole (an ``abort`` update; tokens
        kept by an earlier ``continue`` go too). Returns how many tokens are kept now."""
        step = self.original.step
        token_ids, logprobs = partial_of(exc)
        if not keep or not isinstance(step, TokenStep):
            self.request, self.token_ids, self.logprobs, self.versions = self.original, [], [], []
            return 0
        if not token_ids:
            return self.kept
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        # Both budgets count the step's tokens: the kept ones are generated already.
        sampling = replace(step.sampling, max_tokens=max(0, step.sampling.max_tokens - self.kept),
                           min_tokens=max(0, step.sampling.min_tokens - self.kept))
        self.request = replace(self.original, step=replace(step, token_ids=(*step.token_ids, *self.token_ids),
                                                         sampling=sampling))
        return self.kept

    def output(self, out: EngineOutput, version: int) -> EngineOutput:
        """The step's output from the last run's (on ``version``): the kept tokens first, and the
        version of every token (token steps only; other outputs pass as they are)."""
        if not isinstance(self.original.step, TokenStep) or "token_ids" not in out.output:
            return out
        merged: dict[str, Any] = dict(out.output)
        generated = [int(t) for t in out.output["token_ids"]]
        merged["token_ids"] = [*self.token_ids, *generated]
        if "logprobs" in out.output:
            merged["logprobs"] = [*self.logprobs, *(float(p) for p in out.output["logprobs"])]
        merged[VERSIONS_KEY] = [*self.versions, *([version] * len(generated))]
        return EngineOutput(output=merged, context_length=out.context_length)


def first_version(output: Mapping[str, Any], version: int) -> int:
    """The oldest policy version among a step's tokens (``version`` when it reports none)."""
    versions = output.get(VERSIONS_KEY)
    return min(int(v) for v in versions) if versions else version
