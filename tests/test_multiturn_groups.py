"""The group driver (``broker.rollouts.groups``) on a real fleet: a forked group equals independent
rollouts with the same seeds, and over-sampling cancels the stragglers and closes every session."""

from __future__ import annotations

import dataclasses

import pytest

from broker import FleetClient
from broker.rollouts.groups import branch_seed, run_multiturn_group
from broker.rollouts.multiturn import MultiTurnConfig, RolloutSample, RolloutStatus, run_multiturn
from tests.support import WorkerPool
from tests.test_multiturn import QUESTION, MathEnv, ScriptedLM, check_fields, reference_engine

pytestmark = pytest.mark.asyncio


def trained(sample: RolloutSample) -> tuple[object, ...]:
    """What a trainer reads from a sample (session ids differ between runs)."""
    return (sample.tokens, sample.prompt_length, sample.response, sample.loss_mask, sample.rollout_log_probs,
            sample.status, sample.weight_versions, sample.turns, sample.metadata.get("finish_reasons"),
            sample.metadata.get("sampling_seed"))


async def test_a_group_equals_independent_rollouts_with_the_same_seeds(fleet: FleetClient,
                                                                       workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    config = MultiTurnConfig(max_turns=3, max_new_tokens=120, seed=11, stop_token_ids=tuple(range(32, 128)))
    envs: list[MathEnv] = []

    def make_env() -> MathEnv:
        envs.append(MathEnv())
        return envs[-1]

    group = await run_multiturn_group(fleet, make_env, QUESTION, 4, config)
    assert len(group) == 4 and len(envs) == 4
    assert all(env.resets == 1 and env.closes == 1 for env in envs)
    for i, sample in enumerate(group):
        check_fields(sample)
        alone = await run_multiturn(fleet, MathEnv(), QUESTION,
                                    dataclasses.replace(config, seed=branch_seed(11, i, config)))
        assert trained(sample) == trained(alone)
        assert sample.metadata["group"]["branch"] == i
        assert (await fleet.status(sample.session_id)).closed
    parent = group[0].metadata["group"]["parent_session_id"]
    assert (await fleet.status(parent)).closed
    assert len({tuple(sample.tokens) for sample in group}) > 1  # different seeds, different samples


async def test_needed_cancels_the_stragglers_and_closes_every_session(fleet: FleetClient,
                                                                       workers: WorkerPool) -> None:
    # The model always answers 4. Branches 0 and 1 ask for 4 and finish on their first turn; 2 and 3
    # ask for 5 and would go on for 10,000 turns: they only end by the cancel.
    await workers.add(ScriptedLM(["It is 4<|eos|>"]))
    envs: list[MathEnv] = []

    def make_env() -> MathEnv:
        envs.append(MathEnv(answer=4 if len(envs) < 2 else 5))
        return envs[-1]

    config = MultiTurnConfig(model="scripted-lm", max_turns=10_000, max_new_tokens=1_000_000, seed=3)
    group = await run_multiturn_group(fleet, make_env, QUESTION, 4, config, needed=2)
    assert [sample.status for sample in group] == [RolloutStatus.COMPLETED] * 2 + [RolloutStatus.ABORTED] * 2
    for sample in group[2:]:
        check_fields(sample)
        assert sample.metadata["cancelled"] is True
        assert sample.turns < config.max_turns
    assert all(env.closes == 1 for env in envs)
    for sample in group:
        assert (await fleet.status(sample.session_id)).closed
    assert (await fleet.status(group[0].metadata["group"]["parent_session_id"])).closed


async def test_bad_group_arguments_raise_before_any_session(fleet: FleetClient, workers: WorkerPool) -> None:
    for n, needed in ((0, None), (True, None), (2, 3), (2, 0)):
        with pytest.raises(ValueError):
            await run_multiturn_group(fleet, MathEnv, QUESTION, n, MultiTurnConfig(), needed=needed)
