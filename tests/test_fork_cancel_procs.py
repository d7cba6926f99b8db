"""Session.fork and Session.cancel against real worker processes (the CLI): branches and a
cancelled session equal a fault-free replay, before and after their worker is SIGKILLed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode
from schemas.messages import StepResult, TokenStep
from tests.procs import Fleet
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig
from workers.engines.reference_lm import ReferenceLMConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
SHAPE = (1, 4, 2, 8, 10)
# No end-of-sequence token: a step generates exactly max_tokens (a long step to cancel).
ENGINE_ARGS = ["--latent-shape", ",".join(map(str, SHAPE)), "--engine-opt", 'lm={"eos_token_id":-1}']


@pytest.fixture
def fleet_procs(redis_server: RedisServer, prefix: str) -> Iterator[Fleet]:
    procs = Fleet(redis_server.url, prefix)
    yield procs
    procs.close()


def tok(ids: list[int], seed: int, max_tokens: int = 5) -> dict[str, Any]:
    return {"token_ids": ids, "sampling": {"max_tokens": max_tokens, "seed": seed, "temperature": 1.0}}


def fault_free(steps: list[dict[str, Any]]) -> list[list[int]]:
    """The token ids of ``steps`` run as one session straight through one engine."""
    engine = ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, lm=ReferenceLMConfig(eos_token_id=-1)))
    out = []
    for i, data in enumerate(steps):
        [res] = engine.run_direct("reference-lm", [EngineRequest("s", "reference-lm", TokenStep.from_wire(data),
                                                                 reset=i == 0)])
        assert isinstance(res, EngineOutput)
        out.append(list(res.output["token_ids"]))
    return out


def ids(result: StepResult) -> list[int]:
    assert result.ok, result.error
    return list(result.output["token_ids"])


async def test_branches_and_a_cancelled_branch_match_replay_across_a_sigkill(fleet_procs: Fleet) -> None:
    fleet_procs.supervisor()
    first = fleet_procs.worker(*ENGINE_ARGS, engine="reference")
    await fleet_procs.wait_active(1)
    async with FleetClient(fleet_procs.url, prefix=fleet_procs.prefix) as fleet:
        parent = await fleet.create_session(model="reference-lm", mode="tokens")
        trunk = [tok([5 + i, 6], seed=i) for i in range(3)]
        for i, step in enumerate(trunk):
            ids(await parent.step(i, **step))
        branches = await parent.fork(3)
        own = [[tok([20 + j], seed=100 + j)] for j in range(3)]
        for b, o in zip(branches, own, strict=True):
            assert ids(await b.step(3, **o[0])) == fault_free([*trunk, *o])[3]
        # Cancel branch 0 with 5 long steps queued: those not committed answer cancelled.
        victim = branches[0]
        slow = [victim.submit(4 + i, **tok([30 + i], seed=i, max_tokens=3000)) for i in range(5)]
        for _ in range(2000):  # bounded: until the submit tasks have enqueued all five
            if (await victim.status()).next_step_id == 9:
                break
            await asyncio.sleep(0.005)
        outcome = await victim.cancel()
        results = await asyncio.wait_for(asyncio.gather(*slow), 120)
        committed = outcome.committed_step_id
        assert outcome.cancelled_steps == range(committed + 1, 9) and outcome.next_step_id == committed + 1
        for step_id, r in zip(range(4, 9), results, strict=True):
            if step_id <= committed:
                own[0].append(tok([30 + step_id - 4], seed=step_id - 4, max_tokens=3000))
                assert r.ok
            else:
                assert r.error is not None and r.error.code is ErrorCode.CANCELLED, r.error
        assert (await victim.status()).committed_step_id == committed
        # SIGKILL the worker: a new one takes the branches over and rebuilds them from their records.
        fleet_procs.worker(*ENGINE_ARGS, engine="reference")
        await fleet_procs.wait_active(2)
        first_id = parent.owner
        first.kill()
        for b, o in zip(branches, own, strict=True):
            nxt = tok([40, 41], seed=7)
            step_id = 3 + len(o)
            got = await b.step(step_id, **nxt, timeout=60)
            assert ids(got) == fault_free([*trunk, *o, nxt])[step_id]
            assert got.worker_id != first_id
