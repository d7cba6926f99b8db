"""AReaL 1.0's real RLVRWorkflow and MultiTurnWorkflow, unchanged, rolling out on a real fleet through
``broker.integrations.areal.FleetInferenceEngine`` (their ``arun_episode(engine, data)`` calls
``engine.agenerate(ModelRequest)`` and reads AReaL's ``ModelResponse``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker import FleetClient
from broker.integrations import vime
from broker.integrations.areal import ArealFleetSettings, FleetInferenceEngine
from broker.redis.embedded import RedisServer
from tests.areal.conftest import requires_areal
from tests.areal.rewards import completion_length, says_four
from tests.support import WorkerPool
from tests.test_multiturn import LOGPROB, ScriptedLM, reference_engine
from tests.verl.hf_reference_tokenizer import hf_reference_tokenizer

pytestmark = [pytest.mark.areal, requires_areal]
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
async def engine(redis_server: RedisServer, prefix: str) -> AsyncIterator[FleetInferenceEngine]:
    """The engine as a trainer makes it: from settings (it connects its own client on first use)."""
    fleet_engine = FleetInferenceEngine(ArealFleetSettings(redis_url=redis_server.url, prefix=prefix))
    fleet_engine.initialize()
    yield fleet_engine
    await fleet_engine.aclose()
    fleet_engine.destroy()
    await vime.close_fleets()


def gconfig(**fields: Any) -> Any:
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(**{"max_new_tokens": 24, **fields})


def test_the_engine_answers_every_method_of_areals_inference_engine() -> None:
    from areal.api.engine_api import InferenceEngine

    public = {name for name, _ in inspect.getmembers(InferenceEngine) if not name.startswith("_")}
    assert public <= set(dir(FleetInferenceEngine)), public - set(dir(FleetInferenceEngine))


async def test_agenerate_answers_an_areal_model_request(engine: FleetInferenceEngine, workers: WorkerPool) -> None:
    from areal.api.io_struct import ModelRequest, ModelResponse
    from areal.utils.hf_utils import apply_chat_template

    await workers.add(reference_engine())
    tok = hf_reference_tokenizer()
    ids = apply_chat_template(tok, QUESTION, tokenize=True, add_generation_prompt=True)
    config = gconfig().new_with_stop_and_pad_token_ids(tok)
    resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=config, tokenizer=tok))
    assert isinstance(resp, ModelResponse) and resp.input_tokens == ids and 0 < resp.output_len <= 24
    assert len(resp.output_logprobs) == len(resp.output_versions) == resp.output_len
    assert resp.output_versions == [0] * resp.output_len and resp.stop_reason in ("stop", "length")
    assert resp.end_with_stop == (resp.stop_reason == "stop")
    assert resp.output_tokens_without_stop == resp.output_tokens[:resp.output_len - int(resp.end_with_stop)]


async def test_rlvr_workflow_groups_on_the_reference_lm(engine: FleetInferenceEngine, workers: WorkerPool,
                                                        fleet: FleetClient) -> None:
    from areal.workflow.rlvr import RLVRWorkflow

    await workers.add(reference_engine())
    workflow = RLVRWorkflow(reward_fn=completion_length, gconfig=gconfig(), tokenizer=hf_reference_tokenizer())
    data = [{"messages": QUESTION}, {"messages": [{"role": "user", "content": "Name a prime."}]}]
    # group_size 2: AReaL's own GroupedRolloutWorkflow runs each episode twice and concatenates them.
    trajectories = await engine.arollout_batch(data, workflow, group_size=2)
    assert len(trajectories) == 2
    for traj in trajectories:
        assert traj["input_ids"].shape[0] == 2 and set(traj) >= {"input_ids", "loss_mask", "logprobs", "versions",
                                                                    "rewards", "attention_mask"}
        for row in range(2):
            mask = traj["loss_mask"][row].bool() & traj["attention_mask"][row]
            generated = int(mask.sum())
            assert 0 < generated <= 24 and float(traj["rewards"][row]) == float(generated)
            assert (traj["logprobs"][row][mask] <= 0).all() and (traj["logprobs"][row][~mask] == 0).all()
            assert traj["versions"][row][mask].tolist() == [0] * generated  # the fleet's weight version
            assert set(traj["versions"][row][~mask & traj["attention_mask"][row]].tolist()) == {-1}
    # Four episodes, four sessions, each closed with its episode.
    assert engine.export_stats()["fleet/sessions_opened"] == 4.0 and engine.open_session_ids() == []


async def test_multi_turn_workflow_continues_one_session(engine: FleetInferenceEngine, workers: WorkerPool,
                                                         fleet: FleetClient) -> None:
    from areal.workflow.multi_turn import MultiTurnWorkflow

    lm = ScriptedLM(["It is 5<|eos|>", "It is 4<|eos|>"])
    await workers.add(lm)
    engine.settings = dataclasses.replace(engine.settings, model="scripted-lm")
    tok = hf_reference_tokenizer()
    workflow = MultiTurnWorkflow(reward_fn=says_four, gconfig=gconfig(), tokenizer=tok, max_turns=3,
                                 turn_discount=0.5)
    async with engine.episode():
        traj = await workflow.arun_episode(engine, {"messages": QUESTION})
        (session_id,) = engine.open_session_ids()
    # Two turns (the first answer earned 0), one session: the second request, sent whole by the
    # workflow under a new rid, reached the worker as only the feedback turn's tokens.
    assert float(traj["rewards"][0]) == 0.5
    stats = engine.export_stats()
    assert (stats["fleet/requests"], stats["fleet/sessions_opened"], stats["fleet/continued"]) == (2.0, 1.0, 1.0)
    status = await fleet.status(session_id)
    assert (status.committed_step_id, status.closed) == (1, True)
    seq = traj["input_ids"][0].tolist()
    (context,) = {**lm.contexts, **lm.final}.values()
    assert context == seq  # the worker's context is exactly AReaL's trajectory
    mask = traj["loss_mask"][0].tolist()
    text = tok.decode([t for t, m in zip(seq, mask, strict=True) if m])
    assert text == "It is 5<|eos|>It is 4<|eos|>"
    assert [lp for lp, m in zip(traj["logprobs"][0].tolist(), mask, strict=True) if m] == [LOGPROB] * mask.count(1)
