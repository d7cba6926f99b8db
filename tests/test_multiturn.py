"""The multi-turn token rollout driver on a real fleet: a toy Geo3K-like math env over the reference
LM, and a scripted LM engine for exact cases (stop strings, budgets, abort, errors)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.rollouts.chat_tokens import observation_token_ids
from broker.rollouts.multiturn import MultiTurnConfig, RolloutSample, RolloutStatus, run_multiturn
from schemas.messages import Mode, TokenStep
from schemas.reference_tokenizer import ASSISTANT_ID, END_ID, EOS_ID, USER_ID, ReferenceTokenizer
from tests.support import WorkerPool
from workers.engines.base import Engine, EngineOutput, EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

TOK = ReferenceTokenizer()
QUESTION = [{"role": "user", "content": "In triangle ABC, AB = 2 and BC = 2. What is AB + BC?"}]
LOGPROB = -0.5


class MathEnv:
    """Geo3K-like: the last number in the reply is the answer; wrong answers get feedback text."""

    def __init__(self, answer: int = 4, *, fail_step: bool = False, fail_close: bool = False) -> None:
        self.answer, self.fail_step, self.fail_close = answer, fail_step, fail_close
        self.resets = self.closes = 0
        self.replies: list[str] = []

    def reset(self) -> None:
        self.resets += 1

    def step(self, response: str) -> tuple[str, bool, dict[str, Any]]:
        if self.fail_step:
            raise RuntimeError("env exploded")
        self.replies.append(response)
        numbers = re.findall(r"-?\d+", response)
        guess = int(numbers[-1]) if numbers else None
        correct = guess == self.answer
        feedback = "Correct." if correct else f"Your answer {guess} is wrong. Reply with the number only."
        return feedback, correct, {"correct": correct, "guess": guess}

    def format_observation(self, observation: str) -> dict[str, str]:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        self.closes += 1
        if self.fail_close:
            raise OSError("close failed")


class ScriptedLM(Engine):
    """``scripted-lm``: turn k of every session emits ``script[k]`` (special names parsed), up to
    a stop token or max_tokens. ``!abort`` aborts; ``!error`` raises. Keeps each session's context
    and records the final one when the session is dropped."""

    kind = "scripted"

    def __init__(self, script: Sequence[str], layers: int = 2, top_k: int = 2) -> None:
        self.script, self.layers, self.top_k = list(script), layers, top_k
        self.contexts: dict[str, list[int]] = {}
        self.final: dict[str, list[int]] = {}
        self.max_tokens: list[int] = []

    def models(self) -> Mapping[str, Mode]:
        return {"scripted-lm": Mode.TOKENS}

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        return [self._one(r) for r in requests]

    def _one(self, req: EngineRequest) -> EngineOutput | BaseException:
        assert isinstance(req.step, TokenStep)
        context = [] if req.reset else list(self.contexts.get(req.session_key, []))
        turn = [*context, *req.step.token_ids].count(ASSISTANT_ID) - 1  # each turn opens with <|assistant|>
        reply = self.script[min(turn, len(self.script) - 1)]
        if reply == "!error":
            return RuntimeError("scripted engine failure")
        before = max(len(context) - 1, 0)
        context.extend(req.step.token_ids)
        self.max_tokens.append(req.step.sampling.max_tokens)
        tokens, finish = self._emit(reply, req.step)
        context.extend(tokens)
        self.contexts[req.session_key] = context
        output: dict[str, Any] = {"token_ids": tokens, "logprobs": [LOGPROB] * len(tokens), "finish_reason": finish}
        if req.step.return_routed_experts:
            output["routed_experts"] = np.zeros((len(context) - 1 - before, self.layers, self.top_k), np.int16)
        return EngineOutput(output=output, context_length=len(context))

    @staticmethod
    def _emit(reply: str, step: TokenStep) -> tuple[list[int], str]:
        if reply == "!abort":
            return [], "abort"
        stops = {EOS_ID, *step.sampling.stop_token_ids}
        tokens: list[int] = []
        for token in TOK.encode(reply)[: step.sampling.max_tokens]:
            tokens.append(token)
            if token in stops:
                return tokens, "stop"
        return tokens, "length"

    def drop_session(self, session_key: str) -> None:
        if session_key in self.contexts:
            self.final[session_key] = self.contexts.pop(session_key)


def reference_engine() -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=(1, 4, 2, 8, 10)))


def check_fields(sample: RolloutSample) -> None:
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m == 0)
    generated = [t for t, m in zip(sample.tokens[sample.prompt_length:], sample.loss_mask, strict=True) if m == 1]
    assert sample.response == TOK.decode(generated)
    assert len(sample.weight_versions) == sum(sample.loss_mask)  # one version per generated token


async def final_context(engine: ScriptedLM, session_id: str) -> list[int]:
    """The worker drops a closed session after its queued jobs: wait for that."""
    for _ in range(200):
        if session_id in engine.final:
            return engine.final[session_id]
        await asyncio.sleep(0.01)
    raise AssertionError(f"session {session_id} was never dropped")


async def run(fleet: FleetClient, env: MathEnv, **config: Any) -> RolloutSample:
    return await run_multiturn(fleet, env, QUESTION, MultiTurnConfig(**{"model": "scripted-lm", **config}))


# --------------------------------------------------------------------------- boundary


def test_observation_boundary_is_the_suffix_of_the_full_rendering() -> None:
    message = {"role": "user", "content": "Try again."}
    after_eos = observation_token_ids(TOK, message, [1, 2, EOS_ID])
    assert after_eos == [USER_ID, *TOK.encode("Try again.", parse_special=False), EOS_ID, ASSISTANT_ID]
    assert observation_token_ids(TOK, message, [1, 2, END_ID]) == [EOS_ID, *after_eos]
    prompt = TOK.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert isinstance(prompt, list)
    reply = [*TOK.encode("It is 5"), EOS_ID]
    full = TOK.apply_chat_template([*QUESTION, {"role": "assistant", "content": "It is 5"}, message],
                                   add_generation_prompt=True)
    assert full == prompt + reply + observation_token_ids(TOK, message, prompt + reply)


# --------------------------------------------------------------------------- reference LM


async def test_reference_lm_rollout_fields_and_routed_experts(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    config = MultiTurnConfig(max_turns=3, max_new_tokens=120, seed=11, stop_token_ids=tuple(range(32, 128)),
                             return_routed_experts=True)
    env = MathEnv()
    sample = await run_multiturn(fleet, env, QUESTION, config)
    check_fields(sample)
    assert sample.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
    assert sample.turns >= 2 and len(env.replies) == sample.turns  # the stop ids end turns early
    assert env.resets == 1 and env.closes == 1
    assert sample.routed_experts is not None
    assert sample.routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
    assert (await fleet.status(sample.session_id)).closed
    again = await run_multiturn(fleet, MathEnv(), QUESTION, config)  # same seed, same sample
    assert again.tokens == sample.tokens and again.rollout_log_probs == sample.rollout_log_probs
    assert np.array_equal(again.routed_experts, sample.routed_experts)  # type: ignore[arg-type]


async def test_reference_lm_length_truncates(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sample = await run_multiturn(fleet, MathEnv(), QUESTION, MultiTurnConfig(max_new_tokens=12, seed=3))
    check_fields(sample)
    assert sample.status is RolloutStatus.TRUNCATED and sample.response_length <= 12
    assert sample.metadata["multiturn_truncation"]["reason"] in ("length", "max_turns",
                                                                 "insufficient_budget_for_next_turn")


# --------------------------------------------------------------------------- scripted LM


async def test_completed_after_feedback_with_exact_masks(fleet: FleetClient, workers: WorkerPool) -> None:
    engine = ScriptedLM(["I think 5<|eos|>", "It is 4<|eos|>"])
    await workers.add(engine)
    env = MathEnv()
    sample = await run(fleet, env, max_turns=4)
    check_fields(sample)
    assert sample.status is RolloutStatus.COMPLETED and sample.turns == 2
    gen1, gen2 = TOK.encode("I think 5<|eos|>"), TOK.encode("It is 4<|eos|>")
    obs = observation_token_ids(TOK, env.format_observation("Your answer 5 is wrong. Reply with the number only."),
                                [EOS_ID])
    assert sample.tokens[sample.prompt_length:] == gen1 + obs + gen2
    assert sample.loss_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    assert sample.rollout_log_probs == [LOGPROB] * len(gen1) + [0.0] * len(obs) + [LOGPROB] * len(gen2)
    assert env.replies == ["I think 5<|eos|>", "It is 4<|eos|>"]
    assert sample.metadata["env_info"] == {"correct": True, "guess": 4}
    assert await final_context(engine, sample.session_id) == sample.tokens  # the worker's context is the sample


async def test_stop_string_appends_a_non_trainable_eos(fleet: FleetClient, workers: WorkerPool) -> None:
    engine = ScriptedLM(["So 5<|end|>", "So 4<|end|>"])
    await workers.add(engine)
    sample = await run(fleet, MathEnv(), stop=("<|end|>",))
    check_fields(sample)
    assert sample.status is RolloutStatus.COMPLETED
    response = sample.tokens[sample.prompt_length:]
    first = TOK.encode("So 5<|end|>")
    assert response[: len(first) + 1] == [*first, EOS_ID] and sample.loss_mask[len(first)] == 0
    assert response[-1] == EOS_ID and sample.loss_mask[-1] == 0
    assert await final_context(engine, sample.session_id) == sample.tokens[:-1]  # the last EOS never reached the worker
    assert first[-1] == END_ID
    with pytest.raises(ValueError, match="routed experts"):
        MultiTurnConfig(stop=("<|end|>",), return_routed_experts=True)
    with pytest.raises(ValueError, match="single tokens"):
        await run(fleet, MathEnv(), stop=("two tokens",))


async def test_budget_and_turn_limits(fleet: FleetClient, workers: WorkerPool) -> None:
    engine = ScriptedLM(["I think 5<|eos|>"])
    await workers.add(engine)
    prompt_length = len(TOK.apply_chat_template(QUESTION, add_generation_prompt=True))
    gen = len(TOK.encode("I think 5<|eos|>"))

    turns = await run(fleet, MathEnv(), max_turns=2)
    assert turns.status is RolloutStatus.TRUNCATED and turns.turns == 2
    assert turns.metadata["multiturn_truncation"] == {"reason": "max_turns", "max_turns": 2}

    no_room = await run(fleet, MathEnv(), max_new_tokens=gen + 5)
    check_fields(no_room)
    assert no_room.metadata["multiturn_truncation"]["reason"] == "insufficient_budget_for_next_turn"
    assert no_room.response_length == gen and no_room.turns == 1

    engine.max_tokens.clear()
    limited = await run(fleet, MathEnv(), context_limit=prompt_length + 3, max_new_tokens=100)
    assert engine.max_tokens == [3] and limited.response_length == 3
    assert limited.metadata["multiturn_truncation"]["reason"] == "length"

    nothing = await run(fleet, MathEnv(), max_new_tokens=0)
    assert nothing.status is RolloutStatus.TRUNCATED and nothing.turns == 0 and nothing.response_length == 0
    assert nothing.metadata["multiturn_truncation"]["reason"] == "insufficient_budget"
    assert (await fleet.status(nothing.session_id)).closed


async def test_no_budget_left_for_the_stop_eos(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["So 5<|end|>"]))
    budget = len(TOK.encode("So 5<|end|>"))
    sample = await run(fleet, MathEnv(), stop=("<|end|>",), max_new_tokens=budget)
    check_fields(sample)
    assert sample.status is RolloutStatus.TRUNCATED and sample.response_length == budget
    assert sample.metadata["multiturn_truncation"]["reason"] == "insufficient_budget_for_stop_eos"


async def test_routed_experts_are_concatenated_per_step(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "5 again<|eos|>", "It is 4<|eos|>"], layers=3, top_k=1))
    sample = await run(fleet, MathEnv(), return_routed_experts=True)
    assert sample.status is RolloutStatus.COMPLETED and sample.turns == 3
    assert sample.routed_experts is not None and sample.routed_experts.shape == (len(sample.tokens) - 1, 3, 1)


async def test_abort_and_failed_steps(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "!abort"]))
    env = MathEnv()
    aborted = await run(fleet, env)
    check_fields(aborted)
    assert aborted.status is RolloutStatus.ABORTED and aborted.turns == 2 and env.closes == 1
    assert aborted.metadata["finish_reasons"] == ["stop", "abort"]


async def test_failed_step_ends_the_sample_and_closes_the_env(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "!error"]), max_attempts=1)
    env = MathEnv()
    failed = await run(fleet, env)
    check_fields(failed)
    assert failed.status is RolloutStatus.FAILED and env.closes == 1
    assert failed.metadata["error"]["code"] == "inference_error" and failed.metadata["error"]["step_id"] == 1
    assert (await fleet.status(failed.session_id)).committed_step_id == 0


async def test_env_close_runs_when_the_env_raises(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>"]))
    env = MathEnv(fail_step=True)
    with pytest.raises(RuntimeError, match="env exploded"):
        await run(fleet, env)
    assert env.closes == 1
    both = MathEnv(fail_step=True, fail_close=True)
    with pytest.raises(RuntimeError, match="env exploded") as info:
        await run(fleet, both)
    assert isinstance(info.value.__cause__, OSError) and both.closes == 1
    closing = MathEnv(fail_close=True)
    with pytest.raises(OSError, match="close failed"):
        await run(fleet, closing, max_turns=1)
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnConfig(max_turns=0)
