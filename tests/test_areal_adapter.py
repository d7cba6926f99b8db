"""The AReaL inference engine on a real fleet, without areal installed (the AReaL tier, tests/areal/,
runs AReaL's own workflows through it): AReaL's gconfig mapped or refused, one session per
conversation with only new tokens sent, forked groups, episodes that close their sessions,
staleness, and the parts of AReaL's engine the fleet does not offer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from broker import FleetClient
from broker.integrations.areal import ArealFleetSettings, FleetInferenceEngine, UnsupportedByFleet
from broker.integrations.areal_requests import fleet_sampling, generated
from broker.ops.weights import update_weights
from schemas.errors import ErrorCode, InvalidRequestError, StalePolicyError
from schemas.messages import StepResult
from schemas.reference_tokenizer import EOS_ID, ReferenceTokenizer
from tests.support import WorkerPool
from tests.test_multiturn import LOGPROB, ScriptedLM, reference_engine

TOK = ReferenceTokenizer()
FEEDBACK = [*TOK.encode("<|user|>Try again.<|eos|><|assistant|>")]


@dataclass
class GConfig:
    """AReaL's GenerationHyperparameters fields and defaults (areal 1.0.4), stop and pad ids added."""

    n_samples: int = 1
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    max_tokens: int = 32768
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = int(1e8)
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])
    ignore_eos: bool = False
    stop: list[str] | None = None
    frequency_penalty: float = 0.0
    use_beam_search: bool = False


@dataclass
class Request:
    input_ids: list[int]
    gconfig: GConfig = field(default_factory=GConfig)
    tokenizer: Any = None
    image_data: list[str] | None = None


@dataclass
class Response:
    """AReaL's ModelResponse fields the engine fills."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    tokenizer: Any
    latency: float
    ttft: float
    itl: list[float]


class HFTokenizer:
    """The one call the engine makes on a request's (Hugging Face) tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return TOK.encode(text, parse_special=False)


def prompt(text: str) -> list[int]:
    ids = TOK.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert isinstance(ids, list)
    return ids


@pytest.fixture
async def engine(fleet: FleetClient) -> AsyncIterator[FleetInferenceEngine]:
    fleet_engine = FleetInferenceEngine(fleet=fleet, response_type=Response)
    yield fleet_engine
    await fleet_engine.aclose()


def test_gconfig_becomes_fleet_sampling_or_is_refused() -> None:
    assert fleet_sampling(GConfig(), 10) == {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                             "stop_token_ids": [EOS_ID]}
    greedy = fleet_sampling(GConfig(greedy=True, top_k=5, max_tokens=14, stop=["!"]), 10, HFTokenizer())
    assert (greedy["temperature"], greedy["top_k"], greedy["max_tokens"]) == (0.0, 5, 4)
    assert greedy["stop_token_ids"] == [EOS_ID, TOK.encode("!")[0]]
    for gconfig, words in ((GConfig(ignore_eos=True), "ignore_eos"), (GConfig(min_new_tokens=2), "min_new_tokens"),
                           (GConfig(frequency_penalty=0.5), "frequency_penalty"),
                           (GConfig(use_beam_search=True), "use_beam_search"),
                           (GConfig(max_tokens=10), "no room"), (GConfig(stop=["ab"]), "2 tokens")):
        with pytest.raises(InvalidRequestError, match=words):
            fleet_sampling(gconfig, 10, HFTokenizer())


def test_output_versions_are_the_steps_per_token_weight_versions() -> None:
    output = {"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3], "finish_reason": "length",
              "weight_versions": [3, 3, 4]}
    gen = generated(StepResult("s", 0, True, 0, output=output, policy_version=4))
    assert (gen.tokens, gen.versions, gen.stop_reason) == ([1, 2, 3], [3, 3, 4], "length")
    assert generated(StepResult("s", 0, True, 0, output={**output, "finish_reason": "abort"})).stop_reason == "abort"
    with pytest.raises(InvalidRequestError, match="2 versions"):
        generated(StepResult("s", 0, True, 0, output={**output, "weight_versions": [1, 1]}))


async def test_agenerate_on_the_reference_lm(engine: FleetInferenceEngine, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    ids = prompt("2 + 2?")
    resp = await engine.agenerate(Request(ids))
    assert isinstance(resp, Response) and resp.input_tokens == ids and 0 < len(resp.output_tokens) <= 16
    assert len(resp.output_logprobs) == len(resp.output_tokens) and all(lp <= 0.0 for lp in resp.output_logprobs)
    assert resp.output_versions == [0] * len(resp.output_tokens)
    assert resp.stop_reason == ("stop" if resp.output_tokens[-1] == EOS_ID else "length")
    assert 0 < resp.latency == resp.ttft < 60 and resp.itl == []
    with pytest.raises(InvalidRequestError, match="agenerate_group"):
        await engine.agenerate(Request(ids, GConfig(n_samples=2)))
    for bad in (Request([]), Request(ids, image_data=["x"])):
        with pytest.raises(InvalidRequestError):
            await engine.agenerate(bad)


async def test_a_conversation_continues_its_session_with_only_new_tokens(
        engine: FleetInferenceEngine, workers: WorkerPool) -> None:
    lm = ScriptedLM(["It is 5<|eos|>", "It is 4<|eos|>"])
    await workers.add(lm)
    engine.settings = ArealFleetSettings(model="scripted-lm")
    first_ids = prompt("2 + 2?")
    first = await engine.agenerate(Request(first_ids))
    (session_id,) = engine.open_session_ids()
    # AReaL's MultiTurnWorkflow: the whole history again, under a new rid, plus the feedback turn.
    second_ids = [*first_ids, *first.output_tokens, *FEEDBACK]
    second = await engine.agenerate(Request(second_ids))
    assert TOK.decode(first.output_tokens) == "It is 5<|eos|>" and TOK.decode(second.output_tokens) == "It is 4<|eos|>"
    assert engine.open_session_ids() == [session_id] and second.output_logprobs == [LOGPROB] * 8
    assert lm.contexts[session_id] == [*second_ids, *second.output_tokens]  # the worker holds the trajectory
    other = await engine.agenerate(Request(prompt("3 + 3?")))  # another prompt: another session
    assert TOK.decode(other.output_tokens) == "It is 5<|eos|>" and len(engine.open_session_ids()) == 2
    assert engine.export_stats() == {"fleet/requests": 3.0, "fleet/sessions_opened": 2.0, "fleet/continued": 1.0,
                                     "fleet/stale_dropped": 0.0}


async def test_an_episode_closes_its_sessions_and_keeps_its_conversations_to_itself(
        engine: FleetInferenceEngine, workers: WorkerPool, fleet: FleetClient) -> None:
    await workers.add(ScriptedLM(["It is 5<|eos|>"]))
    engine.settings = ArealFleetSettings(model="scripted-lm", max_open_conversations=1)
    ids = prompt("2 + 2?")
    outside = await engine.agenerate(Request(ids))
    async with engine.episode():
        # The same history in an episode does not continue a conversation started outside it.
        inside = await engine.agenerate(Request([*ids, *outside.output_tokens, *FEEDBACK]))
        assert inside.input_tokens[-len(FEEDBACK):] == FEEDBACK
        (episode_session,) = engine.open_session_ids()
    assert (await fleet.status(episode_session)).closed
    (kept,) = engine.open_session_ids()
    await engine.agenerate(Request(prompt("3 + 3?")))  # over max_open_conversations: the oldest closes
    assert (await fleet.status(kept)).closed and kept not in engine.open_session_ids()


async def test_a_group_forks_one_prompt_into_n_samples(engine: FleetInferenceEngine, workers: WorkerPool,
                                                       fleet: FleetClient) -> None:
    await workers.add(reference_engine())
    ids = prompt("Count:")
    async with engine.episode():
        group = await engine.agenerate_group(Request(ids, GConfig(n_samples=3, max_new_tokens=12)))
        opened = engine.open_session_ids()
        assert len(group) == 3 and len(opened) == 4  # the parent (holding the prompt) and three branches
        assert all(r.input_tokens == ids and len(r.output_logprobs) == len(r.output_tokens) > 0 for r in group)
        statuses = [await fleet.status(sid) for sid in opened]
        assert [s.committed_step_id for s in statuses] == [0, 1, 1, 1]
        branches = zip(statuses[1:], group, strict=True)
        assert all(s.context_length == len(ids) + len(r.output_tokens) for s, r in branches)
        turn = await engine.agenerate(Request([*ids, *group[1].output_tokens, *FEEDBACK]))  # continues branch 1
        assert engine.export_stats()["fleet/continued"] == 1.0 and len(turn.output_tokens) > 0
    assert all([(await fleet.status(sid)).closed for sid in opened])
    for n in (0, 257):
        with pytest.raises(InvalidRequestError, match="n_samples"):
            await engine.agenerate_group(Request(ids, GConfig(n_samples=n)))
    assert engine.open_session_ids() == []  # refused before any session was opened


async def test_a_conversation_past_its_staleness_bound_is_dropped(
        engine: FleetInferenceEngine, workers: WorkerPool, fleet: FleetClient) -> None:
    await workers.add(ScriptedLM(["It is 5<|eos|>", "It is 4<|eos|>"]))
    engine.settings = ArealFleetSettings(model="scripted-lm", max_staleness=0)

    class TwoTurns:
        """A workflow shaped as AReaL's: the trainer publishes new weights between the turns."""

        async def arun_episode(self, eng: FleetInferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
            first = await eng.agenerate(Request(data["ids"]))
            if data["update"]:
                await update_weights(fleet.redis, fleet.keys, model="scripted-lm", version=1, path="-")
            second = await eng.agenerate(Request([*data["ids"], *first.output_tokens, *FEEDBACK]))
            return {"tokens": second.input_tokens + second.output_tokens}

    fresh = await engine.arollout_batch([{"ids": prompt("2 + 2?"), "update": True}], TwoTurns())
    assert fresh == [] and engine.export_stats()["fleet/stale_dropped"] == 1.0
    with pytest.raises(StalePolicyError):  # without arollout_batch, the step's error reaches the workflow
        await TwoTurns().arun_episode(engine, {"ids": prompt("3 + 3?"), "update": False})
    assert engine.open_session_ids() == []  # the refused conversation was closed


async def test_areal_config_maps_to_admission_and_staleness() -> None:
    config = SimpleNamespace(max_head_offpolicyness=2, consumer_batch_size=64, request_timeout=3600.0)
    settings = ArealFleetSettings.from_areal_config(config, "grpo", group_size=4, model="my-policy")
    assert settings.admission is not None and settings.max_staleness == 2 and settings.step_timeout == 3600.0
    assert (settings.admission.name, settings.admission.batch_size, settings.admission.max_offpolicyness) == (
        "grpo", 256, 2)
    assert settings.model == "my-policy" and settings.admission.wait_s == 600.0


async def test_areal_engine_parts_the_fleet_does_not_offer_raise_clearly() -> None:
    engine = FleetInferenceEngine()
    engine.initialize(None, None)
    assert engine.initialized and engine.get_version() == 0
    engine.set_version(3)
    assert engine.get_version() == 3
    for name in ("submit", "wait", "wait_for_task", "rollout_batch", "prepare_batch", "update_weights_from_disk",
                 "launch_server", "pause", "resume", "compute_logp", "pause_generation", "offload"):
        with pytest.raises(UnsupportedByFleet, match=f"InferenceEngine.{name} is not offered") as caught:
            getattr(engine, name)()
        assert isinstance(caught.value, NotImplementedError) and caught.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(NotImplementedError):
        _ = engine.workflow_executor
    engine.destroy()
    assert not engine.initialized
    with pytest.raises(InvalidRequestError, match="max_open_conversations"):
        FleetInferenceEngine(ArealFleetSettings(max_open_conversations=0))
