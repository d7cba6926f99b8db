"""verl 0.9's SingleTurnAgentLoop and ToolAgentLoop, unchanged, rolling out on a real vLLM engine
through the fleet: a ``cli.main worker --engine vllm`` process of the engines venv (vLLM's
in-process ``AsyncLLM`` on the engines tier's tiny Llama, CPU) and verl's loops here, tokenizing with
the tiny model's own Hugging Face tokenizer. What verl reads back (token ids, log probs, finish and
stop reasons) equals vLLM's offline ``LLM.generate`` for the same prompt."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from broker.integrations import vime
from broker.redis.embedded import RedisServer
from tests.verl.conftest import requires_verl
from tests.verl.test_verl_agent_loops import ADD_SCHEMA, SAMPLING, build_loop
from tests.verl.vllm_worker import (
    MODEL_NAME,
    STARTUP_S,
    engines_python,
    offline_greedy,
    start_worker,
    stopped_at_exit,
    tiny_model,
    wait_offline,
    wait_worker_active,
)

# The first test waits for two vLLM starts (the offline anchor, then the worker), each bounded by
# STARTUP_S: the suite's 300 s per test is too tight for both on a busy 2-core machine.
pytestmark = [pytest.mark.verl, requires_verl, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(2 * STARTUP_S + 60)]

RESPONSE_LENGTH = 24
STOPS = list(range(0, 400, 3))  # a third of the tiny vocabulary: greedy decoding stops early on one
SINGLE_TURN = [{"role": "user", "content": "what is 2 + 3?"}]
TOOL_TURN = [{"role": "user", "content": "add 2 and 3"}]


@dataclass
class VLLMFleet:
    keys: dict[str, Any]  # the fleet_* settings of the agent loop config
    model: str  # the tiny model's directory: its tokenizer is the one verl's loops use
    offline: list[list[dict[str, Any]]]  # vLLM's offline answers: [single turn], [tool loop's first turn]


def tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=True)


def prompt_ids(model: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    ids = tokenizer(model).apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("verl-vllm")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_fleet(redis_server: RedisServer, logs: Path) -> AsyncIterator[VLLMFleet]:
    """The vLLM worker and vLLM's offline answers, started together (they overlap on the CPUs)."""
    python = engines_python()
    model = tiny_model(python)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    greedy = {"max_tokens": RESPONSE_LENGTH, "temperature": 0.0}
    conversations = [[{"token_ids": prompt_ids(model, SINGLE_TURN), "sampling": greedy}],
                     [{"token_ids": prompt_ids(model, TOOL_TURN, tools=[ADD_SCHEMA]),
                       "sampling": {**greedy, "stop_token_ids": STOPS}}]]
    offline = offline_greedy(python, model, conversations, logs)
    worker = start_worker(python, model, redis_server.url, prefix, logs)
    with stopped_at_exit(offline, worker):
        answers = wait_offline(offline)
        await wait_worker_active(worker, redis_server.url, prefix)
        yield VLLMFleet({"fleet_redis_url": redis_server.url, "fleet_prefix": prefix, "fleet_model": MODEL_NAME},
                        model, answers)
        await vime.close_fleets()


def loop_on_vllm(tmp_path: Path, fleet: VLLMFleet, target: str, tools: list[Any]) -> Any:
    return build_loop(tmp_path, target, tools, tokenizer=tokenizer(fleet.model),
                      rollout={"response_length": RESPONSE_LENGTH}, **fleet.keys)


def assert_equals_offline(out: Any, expected: dict[str, Any]) -> None:
    """verl's AgentLoopOutput against vLLM's offline answer for the same prompt (bitwise log probs)."""
    assert out.response_ids == expected["token_ids"]
    assert out.response_logprobs == expected["logprobs"]
    assert out.response_mask == [1] * len(out.response_ids)
    assert out.extra_fields["finish_reason"] == expected["finish_reason"]
    assert out.extra_fields.get("stop_reason") == expected.get("stop_reason")
    assert len(out.prompt_ids) + len(out.response_ids) == expected["context_length"]


async def test_single_turn_agent_loop_on_vllm(tmp_path: Path, vllm_fleet: VLLMFleet) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    loop = loop_on_vllm(tmp_path, vllm_fleet, "broker.integrations.verl.FleetSingleTurnAgentLoop", [])
    assert isinstance(loop, SingleTurnAgentLoop)
    out = await loop.run(dict(SAMPLING), raw_prompt=SINGLE_TURN)
    assert isinstance(out, AgentLoopOutput) and out.num_turns == 2
    assert out.prompt_ids == prompt_ids(vllm_fleet.model, SINGLE_TURN)
    [expected] = vllm_fleet.offline[0]
    assert expected["finish_reason"] == "length" and len(out.response_ids) == RESPONSE_LENGTH
    assert_equals_offline(out, expected)
    assert loop.server_manager.open_requests == []


async def test_tool_agent_loop_on_vllm_stops_on_a_stop_token(tmp_path: Path, vllm_fleet: VLLMFleet) -> None:
    """The random tiny model calls no tool: the loop's one assistant turn, ended by a stop token
    verl's sampling params name, comes back as vLLM's own (its stop reason: that token id)."""
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from tests.verl.test_verl_agent_loops import AddTool

    loop = loop_on_vllm(tmp_path, vllm_fleet, "broker.integrations.verl.FleetToolAgentLoop", [AddTool.build()])
    assert isinstance(loop, ToolAgentLoop)
    out = await loop.run({**SAMPLING, "stop_token_ids": STOPS}, raw_prompt=TOOL_TURN)
    assert out.prompt_ids == prompt_ids(vllm_fleet.model, TOOL_TURN, tools=[ADD_SCHEMA])
    [expected] = vllm_fleet.offline[1]
    assert expected["finish_reason"] == "stop" and expected["stop_reason"] in STOPS
    assert out.response_ids[-1] == expected["stop_reason"]
    assert_equals_offline(out, expected)
    assert loop.server_manager.open_requests == []
