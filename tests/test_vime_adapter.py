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
    assert sample.weight_versions == ["0"] * sum(sample.loss_mask)  # one per generated token, as str
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


async def test_generate_group_fills_a_forked_group(args: SimpleNamespace, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "It is 4<|eos|>"]))
    args.n_samples_per_prompt, args.fleet_seed = 4, 21
    group = [Sample(prompt="What is 2 + 2?", label="4", metadata={"index": i}) for i in range(4)]
    built = len(BUILT)
    out = await vime.generate_group(args, group, dict(SAMPLING))
    assert out == group and len(BUILT) == built + 4
    assert all(env.closes == 1 for env in BUILT[built:])
    for i, sample in enumerate(group):
        assert sample.status is Sample.Status.COMPLETED and sample.metadata["index"] == i
        assert sample.response == "I think 5<|eos|>It is 4<|eos|>"
        assert sample.loss_mask is not None and sample.weight_versions == ["0"] * sum(sample.loss_mask)
        assert sample.metadata["sampling_seed"] == 21 + i * args.max_turns
        assert sample.metadata["group"]["branch"] == i


async def test_generate_group_over_samples_and_cancels_the_rest(args: SimpleNamespace, workers: WorkerPool) -> None:
    # The model always answers 4: the samples labelled 5 never finish on their own.
    await workers.add(ScriptedLM(["It is 4<|eos|>"]))
    args.n_samples_per_prompt, args.fleet_group_needed, args.max_turns = 4, 2, 10_000
    group = [Sample(prompt="What is 2 + 2?", label=label) for label in ("4", "5", "4", "5")]
    await vime.generate_group(args, group, {**SAMPLING, "max_new_tokens": 1_000_000})
    statuses = [sample.status for sample in group]
    assert statuses == [Sample.Status.COMPLETED, Sample.Status.ABORTED] * 2
    assert group[1].metadata["cancelled"] is True and group[3].metadata["cancelled"] is True
    assert all(env.closes == 1 for env in BUILT[-4:])


async def test_generate_group_refuses_a_bad_group_and_leaves_it_as_it_was(args: SimpleNamespace,
                                                                         workers: WorkerPool) -> None:
    args.n_samples_per_prompt = 2
    cases: list[tuple[list[Sample], int | None]] = [
        ([Sample(prompt="a"), Sample(prompt="b")], None),  # two prompts
        ([Sample(prompt="a")], None),  # not n_samples_per_prompt
        ([Sample(prompt="a"), Sample(prompt="a")], 3),  # needs more than the group has
        ([Sample(prompt="a"), Sample(prompt="a", response="x")], None),  # not pending
    ]
    for group, needed in cases:
        args.fleet_group_needed = needed
        with pytest.raises(ValueError):
            await vime.generate_group(args, group, dict(SAMPLING))
        assert all(sample.status is Sample.Status.PENDING and not sample.tokens for sample in group)
