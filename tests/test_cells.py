"""A deployment of several cells on one Redis: placement by free capacity across cells, routing
by the cell a session id names, clients that stay in their cell, a results stream per cell."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest

from broker import FleetClient
from broker.client.consumer import ResultConsumer
from broker.redis.cells import known_cells, live_cells
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys, cell_named_by
from schemas.errors import CapacityExhaustedError, InvalidRequestError, SessionNotFoundError
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio
CAPACITY = {"a": 4, "b": 2, "c": 1}


@pytest.fixture
async def cells(workers: WorkerPool) -> WorkerPool:
    """One worker in each of cells a, b and c, with capacities 4, 2 and 1."""
    for cell, capacity in CAPACITY.items():
        await workers.add(NullEngine(), cell=cell, capacity=capacity)
    return workers


@pytest.fixture
async def anywhere(redis_server: RedisServer, prefix: str) -> AsyncIterator[FleetClient]:
    async with FleetClient(redis_server.url, prefix=prefix, cell="*") as client:
        yield client


async def test_workers_register_their_cells(cells: WorkerPool, anywhere: FleetClient) -> None:
    assert await live_cells(anywhere.redis, anywhere.config.prefix, lease_ms=5000) == ["a", "b", "c"]
    assert await known_cells(anywhere.redis, anywhere.config.prefix) == ["a", "b", "c"]
    assert await anywhere.live_cells() == ["a", "b", "c"]


async def test_a_client_of_every_cell_fills_the_cells_by_free_capacity(cells: WorkerPool,
                                                                       anywhere: FleetClient) -> None:
    sessions = [await anywhere.create_session(model="null-world", mode="world_model_env") for _ in range(7)]
    placed = Counter(s.cell for s in sessions)
    assert placed == Counter(CAPACITY)
    # the first three go where the most room was: a (4 free), a (3), then a or b at 2 each (by name: a)
    assert [s.cell for s in sessions[:3]] == ["a", "a", "a"]
    for s in sessions:
        head, _, cell = s.session_id.rpartition("@")
        assert len(head) == 32 and cell == s.cell == cell_named_by(s.session_id)
        assert await anywhere.redis.exists(CellKeys(anywhere.config.prefix, cell).session(s.session_id))
    with pytest.raises(CapacityExhaustedError, match="in any of the cells a, b, c"):
        await anywhere.create_session(model="null-world", mode="world_model_env")
    with pytest.raises(InvalidRequestError, match="no live worker in any cell serves model nope"):
        await anywhere.create_session(model="nope", mode="world_model_env")


async def test_step_status_reset_close_and_attach_route_by_the_id(cells: WorkerPool, anywhere: FleetClient,
                                                                  redis_server: RedisServer, prefix: str) -> None:
    sessions = [await anywhere.create_session(model="null-world", mode="world_model_env") for _ in range(7)]
    assert {s.cell for s in sessions} == {"a", "b", "c"}
    for s in sessions:
        assert (await s.step(0, **world_step(0))).ok
    # another process, also given no cell, finds each session from its id alone
    async with FleetClient(redis_server.url, prefix=prefix, cell="*") as other:
        for s in sessions:
            again = await other.attach(s.session_id)
            assert again.cell == s.cell and again.owner == s.owner
            r = await again.step(1, **world_step(1))
            assert r.ok and r.committed_step_id == 1 and r.worker_id == s.owner
            assert (await other.status(s.session_id)).committed_step_id == 1
            assert await again.reset() == -1
            await again.close()
            assert (await s.status()).closed
        for unknown in ("nobody@a", "nobody@no-such-cell"):
            with pytest.raises(SessionNotFoundError):
                await other.attach(unknown)
        assert set(other._links) == {"a", "b", "c"}  # asking about other cells started no reader there
    later = await sessions[0].step(0, **world_step(0))
    assert later.error is not None and later.error.code.value == "session_closed"


async def test_chosen_ids_name_their_cell(cells: WorkerPool, anywhere: FleetClient) -> None:
    s = await anywhere.create_session(model="null-world", mode="world_model_env", session_id="episode-1")
    assert s.session_id == f"episode-1@{s.cell}" and s.cell == "a"
    t = await anywhere.create_session(model="null-world", mode="world_model_env", session_id="episode-2@c")
    assert t.session_id == "episode-2@c" and t.cell == "c"
    with pytest.raises(InvalidRequestError, match="names cell 'nowhere', which has no workers"):
        await anywhere.create_session(model="null-world", mode="world_model_env", session_id="e@nowhere")
    with pytest.raises(InvalidRequestError, match="at most 200 characters"):
        await anywhere.create_session(model="null-world", mode="world_model_env", session_id="e" * 199)
    for bad in ("e@", "@c", "e@*"):
        with pytest.raises(InvalidRequestError, match="invalid session id"):
            await anywhere.create_session(model="null-world", mode="world_model_env", session_id=bad)
    assert await anywhere.redis.hlen(CellKeys(anywhere.config.prefix, "a").sessions) == 1


async def test_a_client_given_a_cell_stays_in_it(cells: WorkerPool, anywhere: FleetClient,
                                                 redis_server: RedisServer, prefix: str) -> None:
    elsewhere = await anywhere.create_session(model="null-world", mode="world_model_env", session_id="x@a")
    async with FleetClient(redis_server.url, prefix=prefix, cell="b") as pinned:
        ids = [(await pinned.create_session(model="null-world", mode="world_model_env")).session_id for _ in range(2)]
        assert all(i.endswith("@b") for i in ids)  # a has more room, but this client stays in b
        with pytest.raises(CapacityExhaustedError):
            await pinned.create_session(model="null-world", mode="world_model_env")
        for call in (pinned.attach(elsewhere.session_id), pinned.status(elsewhere.session_id),
                     pinned.create_session(model="null-world", mode="world_model_env", session_id="y@a")):
            with pytest.raises(InvalidRequestError, match="this client stays in cell 'b'"):
                await call
    assert (await elsewhere.status()).owner == elsewhere.owner  # nothing changed in cell a


async def test_a_results_stream_and_consumer_group_per_cell(cells: WorkerPool, anywhere: FleetClient) -> None:
    sessions = [await anywhere.create_session(model="null-lm", mode="tokens") for _ in range(7)]
    for s in sessions:
        assert (await s.enqueue(0, results_stream="rollouts", token_ids=[1])).status == "queued"
    got: dict[str, set[str]] = {}
    for cell in ("a", "b", "c"):
        async with ResultConsumer(anywhere, "rollouts", group="trainers", cell=cell) as results:
            seen: set[str] = set()
            for _ in range(50):
                for delivery in await results.read(block_ms=100):
                    seen.add(delivery.result.session_id)
                    assert await delivery.ack()
                if len(seen) == CAPACITY[cell]:
                    break
            got[cell] = seen
    assert got == {cell: {s.session_id for s in sessions if s.cell == cell} for cell in CAPACITY}
    with pytest.raises(InvalidRequestError, match="pass cell="):
        ResultConsumer(anywhere, "rollouts")
