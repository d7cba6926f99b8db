"""Group rollouts: ``n`` multi-turn samples of one prompt that share its prefix (GRPO-style groups),
with over-sampling (keep the first ``needed`` to finish, cancel the rest).

The prompt is rendered once and runs as step 0 of a parent session with ``max_tokens=0``: the
worker's context then holds the prompt and nothing queued, which is what ``Session.fork`` needs.
``fork(n)`` gives the branches (on the parent's worker, sharing the prefix), and each branch rolls
out on its own with its own environment (``env_factory()`` per branch, called in branch order)
and its own seed: branch
``i`` samples with ``seed + i * config.max_turns`` (turn ``k`` adds ``k``), so no two turns of a
group share a seed. Each branch's sample equals what ``run_multiturn`` gives for the same prompt
and that seed (``tests/test_multiturn_groups.py``).

    samples = await run_multiturn_group(fleet, MathEnv, [{"role": "user", "content": question}],
                                        8, MultiTurnConfig(max_turns=3, seed=7), needed=6)

With ``needed=k``, once ``k`` samples finished (``completed`` or ``truncated``) the stragglers are
cancelled (``Session.cancel``): they come back ``aborted`` with ``metadata["cancelled"] = True``,
vime's ABORTED (recycled). Every session of the group, parent and branches, is closed in all cases.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from broker.client import FleetClient, Session
from broker.client.session import MAX_BRANCHES
from broker.rollouts.chat_tokens import ChatTokenizer
from broker.rollouts.multiturn import (
    Environment,
    MultiTurnConfig,
    Rollout,
    RolloutSample,
    RolloutStatus,
    draw_seed,
    render_prompt,
)
from broker.rollouts.render import ChatRenderer
from schemas.errors import ErrorCode, FleetError
from schemas.messages import StepResult
from schemas.reference_tokenizer import ReferenceTokenizer

_SEED_SPACE = 1 << 62
_FINISHED = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


def branch_seed(seed: int, branch: int, config: MultiTurnConfig) -> int:
    """The seed of branch ``branch``: its turns never reuse another branch's seeds."""
    return (seed + branch * config.max_turns) % _SEED_SPACE


async def run_multiturn_group(fleet: FleetClient, env_factory: Callable[[], Environment],
                              messages: Sequence[Mapping[str, Any]], n: int, config: MultiTurnConfig | None = None,
                              *, needed: int | None = None, tokenizer: ChatTokenizer | None = None,
                              renderer: ChatRenderer | None = None) -> list[RolloutSample]:
    """Roll out ``n`` samples of one prompt as a forked group, in branch order. ``needed`` (1..n)
    cancels the stragglers once that many finished. A parent step that fails gives ``n`` samples
    with its error (``failed``; ``aborted`` for ``stale_policy``); bad arguments, a session or fork
    that cannot be made, or an environment that raises, raise (after every session is closed)."""
    config = config or MultiTurnConfig()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BRANCHES:
        raise ValueError(f"n must be an integer in [1, {MAX_BRANCHES}], got {n!r}")
    if needed is not None and (isinstance(needed, bool) or not isinstance(needed, int) or not 1 <= needed <= n):
        raise ValueError(f"needed must be an integer in [1, {n}] or None, got {needed!r}")
    tok: ChatTokenizer = tokenizer if tokenizer is not None else ReferenceTokenizer()
    prompt, features = await render_prompt(messages, config, tok, renderer)
    seed = config.seed if config.seed is not None else draw_seed()
    parent = await fleet.create_session(config.model, "tokens", max_staleness=config.max_staleness)
    sessions = [parent]
    try:
        extra = {} if features is None else {"multimodal": features}
        result = await parent.step(0, token_ids=prompt, sampling={"max_tokens": 0, "seed": seed},
                                   timeout=config.step_timeout, **extra)
        if not result.ok:
            return [_failed(prompt, parent, result, branch_seed(seed, i, config)) for i in range(n)]
        branches = await parent.fork(n)
        sessions.extend(branches)
        samples = [RolloutSample(tokens=list(prompt), prompt_length=len(prompt), session_id=branch.session_id,
                                 metadata={"fleet_session_id": branch.session_id,
                                           "sampling_seed": branch_seed(seed, i, config),
                                           "group": {"parent_session_id": parent.session_id, "branch": i}},
                                 multimodal_features=features)
                   for i, branch in enumerate(branches)]
        return await _run_branches(branches, samples, env_factory, config, tok, needed)
    finally:
        for session in sessions:
            with contextlib.suppress(FleetError, RedisError, OSError):
                await session.close()


def _failed(prompt: list[int], parent: Session, result: StepResult, seed: int) -> RolloutSample:
    error = result.error
    stale = error is not None and error.code is ErrorCode.STALE_POLICY
    return RolloutSample(tokens=list(prompt), prompt_length=len(prompt), session_id=parent.session_id,
                         status=RolloutStatus.ABORTED if stale else RolloutStatus.FAILED,
                         metadata={"fleet_session_id": parent.session_id, "sampling_seed": seed,
                                   "error": {"code": error.code.value if error else "unknown",
                                             "message": error.message if error else "", "step_id": 0}})


async def _run_branches(branches: list[Session], samples: list[RolloutSample],
                        env_factory: Callable[[], Environment], config: MultiTurnConfig, tok: ChatTokenizer,
                        needed: int | None) -> list[RolloutSample]:
    envs = _make_envs(env_factory, len(branches))
    stop, closed = asyncio.Event(), set[int]()
    tasks = [asyncio.create_task(_run_branch(branch, sample, env, config, tok, stop.is_set, closed))
             for branch, sample, env in zip(branches, samples, envs, strict=True)]
    try:
        pending: set[asyncio.Task[RolloutSample]] = set(tasks)
        finished = 0
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished += sum(task.result().status in _FINISHED for task in done)  # re-raises a branch's error
            if needed is not None and finished >= needed and pending and not stop.is_set():
                await _cancel_stragglers(stop, branches, tasks)
        return [task.result() for task in tasks]
    except BaseException:
        # Stop the branches still running before their sessions close; their errors are secondary.
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for env in envs:  # a branch cancelled before it started never reached its own close
            if id(env) not in closed:
                with contextlib.suppress(Exception):
                    env.close()
        raise


def _make_envs(env_factory: Callable[[], Environment], n: int) -> list[Environment]:
    """The branches' environments, made in branch order (env_factory may hand out per-branch state)."""
    envs: list[Environment] = []
    try:
        for _ in range(n):
            envs.append(env_factory())
    except BaseException:
        for env in envs:
            with contextlib.suppress(Exception):
                env.close()
        raise
    return envs


async def _cancel_stragglers(stop: asyncio.Event, branches: list[Session],
                             tasks: list[asyncio.Task[RolloutSample]]) -> None:
    # The flag first: a straggler between two turns sees it before its next step; a step already
    # queued or running answers ``cancelled`` (its enqueue holds the session's order lock, so the
    # cancel comes after it).
    stop.set()
    for branch, task in zip(branches, tasks, strict=True):
        if not task.done():
            with contextlib.suppress(FleetError, RedisError, OSError):
                await branch.cancel()


async def _run_branch(session: Session, sample: RolloutSample, env: Environment,
                      config: MultiTurnConfig, tok: ChatTokenizer, stopped: Callable[[], bool],
                      closed: set[int]) -> RolloutSample:
    with _closing(env, closed):
        env.reset()
        # The branch's context holds the prompt (the parent's step 0): its first turn is step 1.
        rollout = Rollout(session, config, tok, sample, int(sample.metadata["sampling_seed"]), first_step=1,
                          sent=sample.prompt_length, stopped=stopped)
        await rollout.run(env)
        return rollout.finalize()


@contextlib.contextmanager
def _closing(env: Environment, closed: set[int]) -> Iterator[None]:
    """``env.close()`` always; an error of close does not hide the rollout's own (as run_multiturn)."""
    closed.add(id(env))  # from here on, this block closes it
    try:
        yield
    except BaseException as error:
        try:
            env.close()
        except BaseException as close_error:
            raise error from close_error
        raise
    env.close()
