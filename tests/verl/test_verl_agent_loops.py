"""verl 0.9's real SingleTurnAgentLoop and ToolAgentLoop, unchanged, rolling out on a real fleet
through ``broker.integrations.verl`` (FleetSingleTurnAgentLoop / FleetToolAgentLoop, built by
hydra from an agent-loop config file as verl's AgentLoopWorker builds them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.integrations import vime
from broker.redis.embedded import RedisServer
from tests.support import WorkerPool
from tests.test_multiturn import ScriptedLM, reference_engine
from tests.verl.conftest import requires_verl
from tests.verl.hf_reference_tokenizer import hf_reference_tokenizer

pytestmark = [pytest.mark.verl, requires_verl]

ROLLOUT = {"prompt_length": 256, "response_length": 256, "full_determinism": False,
           "multi_turn": {"max_user_turns": 3, "max_assistant_turns": 3, "max_parallel_calls": 1,
                          "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
                          "format": "hermes"}}
# What verl's AgentLoopWorker.generate_sequences passes (rollout defaults), greedy.
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


@pytest.fixture
async def fleet_keys(redis_server: RedisServer, prefix: str) -> AsyncIterator[dict[str, Any]]:
    yield {"fleet_redis_url": redis_server.url, "fleet_prefix": prefix}
    await vime.close_fleets()


def build_loop(tmp_path: Path, target: str, tools: list[Any], *, tokenizer: Any = None,
               rollout: dict[str, Any] | None = None, **fleet: Any) -> Any:
    """The agent loop as verl builds it: its config file (rollout.agent.agent_loop_config_path),
    then hydra.utils.instantiate with the arguments AgentLoopWorker._run_agent_loop passes.
    ``tokenizer``: default the reference LM's; ``rollout``: keys over ROLLOUT's."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = tmp_path / "agent_loops.yaml"
    OmegaConf.save(OmegaConf.create([{"name": "fleet", "_target_": target, **fleet}]), path)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {**ROLLOUT, **(rollout or {})}},
                               "data": {"apply_chat_template_kwargs": {}}})
    (loop_config,) = OmegaConf.load(path)
    return hydra.utils.instantiate(config=loop_config, trainer_config=DictConfigWrap(config=config),
                                   server_manager=None, tokenizer=tokenizer or hf_reference_tokenizer(), processor=None,
                                   hf_model_type=None, dataset_cls=RLHFDataset,
                                   data_config=DictConfigWrap(config.data), tools=ToolListWrap(tools))


async def test_single_turn_agent_loop_on_the_reference_lm(tmp_path: Path, fleet_keys: dict[str, Any],
                                                          workers: WorkerPool, fleet: FleetClient) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    await workers.add(reference_engine())
    loop = build_loop(tmp_path, "broker.integrations.verl.FleetSingleTurnAgentLoop", [],
                      fleet_return_routed_experts=True, **fleet_keys)
    assert isinstance(loop, SingleTurnAgentLoop)
    messages = [{"role": "user", "content": "2 + 2?"}]
    out = await loop.run(dict(SAMPLING), raw_prompt=messages)
    assert isinstance(out, AgentLoopOutput) and out.num_turns == 2
    expected = hf_reference_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.prompt_ids == list(expected["input_ids"])
    assert 0 < len(out.response_ids) <= ROLLOUT["response_length"] and out.response_mask == [1] * len(out.response_ids)
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)
    assert all(lp <= 0.0 for lp in out.response_logprobs)
    assert isinstance(out.routed_experts, np.ndarray)
    assert out.routed_experts.shape == (len(out.prompt_ids) + len(out.response_ids) - 1, 2, 2)
    session_id = out.extra_fields["fleet_session_id"]
    assert loop.server_manager.open_requests == [] and (await fleet.status(session_id)).closed


class AddTool:
    """A verl BaseTool (built in the test, verl imported lazily) that adds two integers."""

    @staticmethod
    def build() -> Any:
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

        class Add(BaseTool):  # type: ignore[misc]
            async def execute(self, instance_id: str, parameters: dict[str, Any],
                              **kwargs: Any) -> tuple[Any, float, dict[str, Any]]:
                return ToolResponse(text=str(int(parameters["a"]) + int(parameters["b"]))), 0.0, {}

        return Add({}, OpenAIFunctionToolSchema.model_validate(ADD_SCHEMA))


async def test_tool_agent_loop_sends_only_new_tokens_to_one_session(tmp_path: Path, fleet_keys: dict[str, Any],
                                                                    workers: WorkerPool, fleet: FleetClient) -> None:
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    lm = ScriptedLM(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|eos|>',
                     "It is 4<|eos|>"])
    await workers.add(lm)
    loop = build_loop(tmp_path, "broker.integrations.verl.FleetToolAgentLoop", [AddTool.build()],
                      fleet_model="scripted-lm", **fleet_keys)
    assert isinstance(loop, ToolAgentLoop)
    out = await loop.run(dict(SAMPLING), raw_prompt=[{"role": "user", "content": "What is 2 + 2?"}])
    tok = hf_reference_tokenizer()
    text = tok.decode(out.response_ids)
    assert "</tool_call>" in text and text.endswith("It is 4<|eos|>") and "4<|eos|>" in text
    assert 0 in out.response_mask and out.response_mask[-1] == 1  # tool tokens are not trained on
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)
    # Both assistant turns ran on one session (steps 0 and 1, the second sending only the tool
    # turn's tokens) whose context on the worker is exactly verl's trajectory; the loop closed it.
    status = await fleet.status(out.extra_fields["fleet_session_id"])
    assert (status.committed_step_id, status.closed) == (1, True) and loop.server_manager.open_requests == []
    (context,) = {**lm.contexts, **lm.final}.values()  # the worker drops a closed session's context later
    assert context == [*out.prompt_ids, *out.response_ids]
