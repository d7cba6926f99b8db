"""Direct results (schemas/results_wire.py): a large committed result fetched from the worker that committed
it, Redis read whenever that worker cannot answer; the guarantees of the two-hop path unchanged."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.asyncio import Redis

from broker import FleetClient
from broker.client.direct import DirectFetcher
from broker.redis.blobs import STAGE_BYTES
from broker.redis.embedded import RedisServer
from broker.redis.inbox import InboxEntry, JobKind
from broker.redis.keys import CellKeys
from broker.redis.layouts import ReplyEntry
from broker.redis.script_replies import Committed, Created, Duplicate, Queued
from broker.redis.scripts import Scripts
from schemas.errors import Fenced
from schemas.limits import DEFAULT_LIMITS
from schemas.messages import Mode
from schemas.results_wire import parse_address, parse_host_or_address, read_response, request
from tests.support import WorkerPool, until, world_step
from workers.engines.null import NullEngine, NullEngineConfig
from workers.job_scripts import JobScripts
from workers.result_server import HeldResults, ResultServer
from workers.settings import WorkerSettings

pytestmark = pytest.mark.asyncio
LATENT = (1, 16, 2, 44, 80)  # 450,560 float32 bytes: staged, so served directly
SERVE = {"serve_results": "127.0.0.1:0"}


async def _calls(redis: Redis, name: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def _fetcher(fleet: FleetClient) -> DirectFetcher:
    direct = fleet.link(fleet.keys.cell).replies.direct
    assert direct is not None
    return direct


async def _stored_latent(fleet: FleetClient, session_id: str, step: int) -> np.ndarray:
    """The step's latent as Redis keeps it (its result blob), for comparison."""
    keys = fleet.keys_of(session_id)
    raw = await fleet.redis.get(keys.result_blob(session_id, step))
    assert raw is not None
    return np.asarray(ReplyEntry("step", "j", step, raw).step_result(DEFAULT_LIMITS).output["video_latent"])


async def test_a_large_result_comes_from_its_worker_and_redis_sends_it_once(fleet: FleetClient,
                                                                           workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)), **SERVE)
    results_at = await fleet.redis.hget(fleet.keys.worker(running.id), "results_at")
    assert results_at is not None and results_at.decode().startswith("127.0.0.1:")
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=4)
    gets = await _calls(fleet.redis, "get")
    results = [await s.step(step, **world_step(step)) for step in range(4)]
    assert all(r.ok for r in results), [r.error for r in results]
    assert _fetcher(fleet).fetched == 4 and _fetcher(fleet).missed == 0
    assert await _calls(fleet.redis, "get") == gets  # no result left Redis a second time
    for step, result in enumerate(results):  # bitwise the committed bytes Redis keeps
        assert np.array_equal(result.output["video_latent"], await _stored_latent(fleet, s.session_id, step))
    held = running.worker._results
    assert held is not None and len(held.held) == 0 and held.held.bytes == 0  # each taken once
    registry = running.worker.metrics.fleet.registry
    assert registry.get_sample_value("rollout_fleet_results_direct_total", {"outcome": "served"}) == 4
    assert registry.get_sample_value("rollout_fleet_results_held_bytes") == 0
    keys = fleet.keys_of(s.session_id)

    async def unmarked() -> bool:  # each reply marked read, off the reply's path
        return [k async for k in fleet.redis.scan_iter(match=keys.log(s.session_id) + ":blob:*:reader")] == []

    await until(unmarked, "in-place markers left standing")
    again = await s.step(3, **world_step(3))  # a re-sent step: its stored result, from Redis
    assert again.ok and again.duplicate
    assert np.array_equal(again.output["video_latent"], results[3].output["video_latent"])


async def test_concurrent_sessions_fetch_their_results_together(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)), **SERVE)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
                for _ in range(8)]
    for step in range(3):
        results = await asyncio.gather(*(s.step(step, **world_step(step)) for s in sessions))
        assert all(r.ok for r in results), [r.error for r in results]
        for s, result in zip(sessions, results, strict=True):
            assert np.array_equal(result.output["video_latent"], await _stored_latent(fleet, s.session_id, step))
    assert _fetcher(fleet).fetched == 24 and _fetcher(fleet).missed == 0


async def test_a_worker_that_cannot_answer_leaves_the_result_to_redis(fleet: FleetClient,
                                                                      workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)), **SERVE)
    server = running.worker._results
    assert server is not None
    await server.close()  # the advertised address now refuses connections
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
    results = [await s.step(step, **world_step(step)) for step in range(3)]
    assert all(r.ok for r in results), [r.error for r in results]
    direct = _fetcher(fleet)
    assert direct.fetched == 0 and direct.missed >= 1
    for step in (1, 2):
        assert np.array_equal(results[step].output["video_latent"],
                              await _stored_latent(fleet, s.session_id, step))


async def test_a_client_without_direct_results_reads_redis_and_the_worker_lets_go(
        redis_server: RedisServer, prefix: str, workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)),
                                results_hold_s=0.2, **SERVE)
    url = redis_server.url
    async with FleetClient(url, prefix=prefix, direct_results=False) as fleet:
        assert fleet.link(fleet.keys.cell).replies.direct is None
        s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
        first = await s.step(0, **world_step(0))
        assert first.ok, first.error
        await asyncio.sleep(0.3)
        second = await s.step(1, **world_step(1))  # its hold lets the first one go
        assert second.ok, second.error
    server = running.worker._results
    assert server is not None and len(server.held) <= 1 and server.held.served == 0
    # the first result went unasked: counted, so that trainers that cannot reach the port show
    assert server.held.unclaimed == 1
    registry = running.worker.metrics.fleet.registry
    assert registry.get_sample_value("rollout_fleet_results_unclaimed_total") == 1


async def test_held_results_are_served_once_and_only_when_committed() -> None:
    held = HeldResults(hold_s=60.0, max_bytes=10_000, wait_s=1.0)
    held.hold("a", b"x" * 100)
    held.settle("a", committed=False)  # fenced, duplicate, error, cancelled: Redis answers
    assert await held.take("a") is None
    held.hold("b", b"y" * 100)
    waiting = asyncio.ensure_future(held.take("b"))  # asked before the commit answered
    await asyncio.sleep(0.05)
    assert not waiting.done()
    held.settle("b", committed=True)
    assert await waiting == b"y" * 100
    assert await held.take("b") is None  # one reader
    assert held.bytes == 0 and held.served == 1


async def test_held_results_wait_for_their_commit_at_most_wait_s() -> None:
    held = HeldResults(hold_s=60.0, max_bytes=10_000, wait_s=0.1)
    held.hold("a", b"x" * 10)
    assert await held.take("a") is None  # never settled: not served
    held.settle("a", committed=True)
    assert await held.take("a") == b"x" * 10


async def test_held_results_are_bounded_in_time_and_bytes() -> None:
    held = HeldResults(hold_s=0.05, max_bytes=250, wait_s=0.1)
    for name in ("a", "b"):
        held.hold(name, b"x" * 100)
        held.settle(name, committed=True)
    held.hold("c", b"x" * 100)  # 300 bytes would pass 250: the oldest goes
    held.settle("c", committed=True)
    assert await held.take("a") is None and held.bytes == 200
    await asyncio.sleep(0.1)
    held.hold("d", b"x" * 10)  # the expired go with the next hold
    assert await held.take("b") is None and await held.take("c") is None
    held.hold("e", b"x" * 1000)  # larger than the whole budget: not kept
    held.settle("e", committed=True)
    assert await held.take("e") is None
    assert held.unclaimed == 3  # a, b, c: committed and dropped untaken; d never committed
    await asyncio.sleep(0.1)
    held.hold("f", b"x")  # d expires uncommitted: not a result anyone could have taken
    assert held.unclaimed == 3


async def test_the_server_closes_a_connection_that_sends_no_request_and_serves_the_next() -> None:
    held = HeldResults(hold_s=60.0, max_bytes=10_000)
    server = ResultServer(held, "127.0.0.1:0")
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, nothing answered
        writer.close()
        held.hold("j", b"z" * 5)
        held.settle("j", committed=True)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request("unknown") + request("j"))
        assert await asyncio.wait_for(read_response(reader), 5.0) is None
        assert await asyncio.wait_for(read_response(reader), 5.0) == b"z" * 5
        writer.close()
    finally:
        await server.close()


async def test_a_fetcher_answers_none_for_a_worker_without_an_address_or_a_dead_one(
        redis_server: RedisServer, prefix: str) -> None:
    redis = Redis.from_url(redis_server.url)
    keys = CellKeys(prefix)
    try:
        direct = DirectFetcher(redis, keys, timeout_s=1.0)
        assert await direct.fetch("w-unknown", ["j"]) == [None]  # no results_at: not asked
        held = HeldResults(hold_s=60.0, max_bytes=10_000)
        server = ResultServer(held, "127.0.0.1:0")
        await server.start()
        port = server.port
        await server.close()
        await redis.hset(keys.worker("w-gone"), "results_at", f"127.0.0.1:{port}")
        assert await direct.fetch("w-gone", ["j", "k"]) == [None, None] and direct.missed == 2
        await redis.hset(keys.worker("w-bad"), "results_at", "no address")
        assert await direct.fetch("w-bad", ["j"]) == [None]
        # a peer that is no result server (Redis itself) breaks the protocol: not used
        await redis.hset(keys.worker("w-redis"), "results_at", f"127.0.0.1:{redis_server.port}")
        assert await direct.fetch("w-redis", ["j"]) == [None] and direct.missed == 3 and direct.fetched == 0
        await direct.close()
    finally:
        await redis.aclose()


async def test_result_serving_settings_are_checked_at_the_edge() -> None:
    with pytest.raises(ValueError, match="results_advertise"):
        WorkerSettings(serve_results="0.0.0.0:7000")
    assert WorkerSettings(serve_results="0.0.0.0:7000", results_advertise="10.0.0.5:7000").serve_results
    with pytest.raises(ValueError, match="durability async"):
        WorkerSettings.from_mapping({"serve_results": "127.0.0.1:0", "durability": "replicated"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        WorkerSettings(serve_results="7000")
    with pytest.raises(ValueError, match="needs serve_results"):
        WorkerSettings(results_advertise="10.0.0.5:7000")
    # a host alone: advertised with the port the worker listens on
    assert WorkerSettings(serve_results="0.0.0.0:0", results_advertise="10.0.0.5").results_advertise == "10.0.0.5"
    assert WorkerSettings(serve_results="[::]:0", results_advertise="[fd00::5]").serve_results
    for advertise, says in (("0.0.0.0", "wildcard"), ("[::]:7000", "wildcard"), ("7000", "a port alone"),
                            ("fd00::5", "brackets"), ("a b", "HOST:PORT")):
        with pytest.raises(ValueError, match=says):
            WorkerSettings(serve_results="0.0.0.0:0", results_advertise=advertise)
    assert np.prod(LATENT) * 4 > STAGE_BYTES


@pytest.mark.parametrize(("text", "parsed"), [
    ("10.0.0.5:7070", ("10.0.0.5", 7070)), ("[fd00::5]:0", ("fd00::5", 0)), ("host-a", ("host-a", None)),
    ("[fd00::5]", ("fd00::5", None)), ("$(POD_IP):7070", ("$(POD_IP)", 7070)),
    ("fd00::5", None), ("7000", None), (":7000", None), ("h:70000", None), ("h:x", None), ("[]:1", None)])
async def test_addresses_and_hosts_parse_or_are_refused(text: str, parsed: tuple[str, int | None] | None) -> None:
    if parsed is None:
        with pytest.raises(ValueError):
            parse_host_or_address(text)
    else:
        assert parse_host_or_address(text) == parsed
    if parsed is None or parsed[1] is None:
        with pytest.raises(ValueError):
            parse_address(text)  # where a port is needed (--serve-results), a host alone is refused
    else:
        assert parse_address(text) == parsed


async def test_a_host_alone_is_advertised_with_the_port_the_worker_got(fleet: FleetClient,
                                                                      workers: WorkerPool) -> None:
    """``--serve-results 0.0.0.0:0 --results-advertise HOST``: how workers that share a host (Ray's
    nodes) each listen on a free port and say where; the trainer fetches from there."""
    running = await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)), serve_results="0.0.0.0:0",
                                results_advertise="127.0.0.1")
    server = running.worker._results
    assert server is not None and server.port != 0
    results_at = await fleet.redis.hget(fleet.keys.worker(running.id), "results_at")
    assert results_at == f"127.0.0.1:{server.port}".encode()
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
    results = [await s.step(step, **world_step(step)) for step in range(2)]
    assert all(r.ok for r in results), [r.error for r in results]
    assert _fetcher(fleet).fetched == 2 and _fetcher(fleet).missed == 0


async def test_only_a_commit_that_committed_is_held_for_its_trainer(scripts: Scripts) -> None:
    """A zombie's fenced commit and a duplicate's re-publish hand nothing out: what a trainer can
    fetch is exactly what Redis committed."""
    await scripts.register("w1", capacity=4, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    assert await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full", result_window=2) == Created("w1")
    assert isinstance(await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="j0", reply_to="c",
                                            payload=b"p"), Queued)
    held = HeldResults(hold_s=60.0, max_bytes=10 * STAGE_BYTES, wait_s=0.1)

    def job_scripts(worker_id: str) -> JobScripts:
        jobs = JobScripts(scripts, WorkerSettings(worker_id=worker_id))
        jobs.held = held
        return jobs

    def job(job_id: str) -> InboxEntry:
        return InboxEntry(entry_id="0-1", kind=JobKind.STEP, job_id=job_id, session_id="s1", step_id=0,
                          contextual=True, epoch=1, gen=0, mode=Mode.TOKENS, model="m", reply_to="c",
                          enqueued_ms=0, attempt=1, payload=b"p")

    large = b"r" * (STAGE_BYTES + 10)
    with pytest.raises(Fenced):
        await job_scripts("w-zombie").commit(job("j0"), large, context_length=1)
    assert await held.take("j0") is None
    answer, _ = await job_scripts("w1").commit(job("j0"), large, context_length=1)
    assert isinstance(answer, Committed)
    answer, _ = await job_scripts("w1").commit(job("j0-again"), b"s" * (STAGE_BYTES + 10), context_length=1)
    assert isinstance(answer, Duplicate)
    assert await held.take("j0-again") is None
    assert await held.take("j0") == large and held.bytes == 0
