"""The vime custom generate function on a real fleet, with minimal stand-ins for vime's Sample and args
(vime is not on PyPI). This module is also the environment module: it exposes ``build_env``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from broker.integrations import vime
from broker.redis.embedded import RedisServer
from schemas.reference_tokenizer import ReferenceTokenizer
from tests.support import WorkerPool
from tests.test_multiturn import MathEnv, ScriptedLM, reference_engine

TOK = ReferenceTokenizer()


@dataclass
class Sample:
    """The fields of vime's Sample the generate function reads and writes."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    prompt: str | list[dict[str, str]] = ""
    label: str | None = None
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    multimodal_train_inputs: Any = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


BUILT: list[MathEnv] = []


def build_env(*, sample: Sample, args: Any) -> MathEnv:
    env = MathEnv(answer=int(sample.label or 4))
    BUILT.append(env)
    return env


@pytest.fixture
async def args(redis_server: RedisServer, prefix: str) -> AsyncIterator[SimpleNamespace]:
    yield SimpleNamespace(fleet_redis_url=redis_server.url, fleet_prefix=prefix, fleet_model="scripted-lm",
                          rollout_interaction_env_path=__name__, max_turns=3, rollout_max_context_len=None,
                          partial_rollout=False, apply_chat_template_kwargs=None,
                          append_eos_token_after_stop_str_in_multi_turn=True, use_rollout_routing_replay=False,
                          fleet_tokenizer=TOK)
    await vime.close_fleets()


SAMPLING = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1}


async def test_generate_fills_the_sample(args: SimpleNamespace, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "It is 4<|eos|>"]))
    sample = Sample(prompt="<image>What is 2 + 2?", label="4", metadata={"id": 7})
    out = await vime.generate(args, sample, dict(SAMPLING))
    assert out is sample and sample.status is Sample.Status.COMPLETED
    prompt = TOK.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    assert isinstance(prompt, list) and sample.tokens[: len(prompt)] == prompt
    assert len(sample.tokens) == len(prompt) + sample.response_length
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.response == "I think 5<|eos|>It is 4<|eos|>"
    assert sample.weight_versions == ["0", "0"]
    assert sample.metadata["id"] == 7 and sample.metadata["fleet_session_id"]
    assert BUILT[-1].closes == 1 and BUILT[-1].replies[-1] == "It is 4<|eos|>"


async def test_reference_lm_with_routing_replay_and_one_fleet_client(args: SimpleNamespace,
                                                                     workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    args.fleet_model, args.fleet_tokenizer = "reference-lm", None  # the reference tokenizer, as asked for
    args.use_rollout_routing_replay, args.num_layers, args.moe_router_topk = True, 2, 2
    params = {**SAMPLING, "seed": 5, "stop_token_ids": list(range(32, 128))}
    first = await vime.generate(args, Sample(prompt=[{"role": "user", "content": "2 + 2?"}]), dict(params))
    client = await vime.fleet_for(args.fleet_redis_url, args.fleet_prefix, "0")
    second = await vime.generate(args, Sample(prompt=[{"role": "user", "content": "2 + 2?"}]), dict(params))
    assert await vime.fleet_for(args.fleet_redis_url, args.fleet_prefix, "0") is client
    assert first.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert first.tokens == second.tokens  # same seed, same sample, on a reused client
    assert isinstance(first.rollout_routed_experts, np.ndarray)
    assert first.rollout_routed_experts.shape == (len(first.tokens) - 1, 2, 2)
    args.moe_router_topk = 4
    with pytest.raises(ValueError, match="routed experts"):
        await vime.generate(args, Sample(prompt="2 + 2?"), dict(params))


async def test_env_module_from_a_file_and_request_checks(args: SimpleNamespace, workers: WorkerPool,
                                                         tmp_path: Path) -> None:
    await workers.add(ScriptedLM(["It is 4<|eos|>"]))
    env_file = tmp_path / "toy_env.py"
    env_file.write_text("from tests.test_multiturn import MathEnv\n\n"
                        "def build_env(sample, args):\n    return MathEnv(answer=4)\n")
    args.rollout_interaction_env_path = str(env_file)
    done = await vime.generate(args, Sample(prompt="2 + 2?"), dict(SAMPLING))
    assert done.status is Sample.Status.COMPLETED
    with pytest.raises(ValueError, match="pending"):
        await vime.generate(args, done, dict(SAMPLING))
    with pytest.raises(ValueError, match="fleet_render_url"):  # images are rendered by a vLLM server
        await vime.generate(args, Sample(prompt="x", multimodal_inputs={"images": ["a.png"]}), dict(SAMPLING))
    args.partial_rollout = True
    with pytest.raises(ValueError, match="partial"):
        await vime.generate(args, Sample(prompt="2 + 2?"), dict(SAMPLING))
