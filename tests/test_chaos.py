"""Chaos: workers SIGKILLed and restarted under load, a zombie worker, a drained worker, Redis
killed and restarted. Every committed result is compared with a fault-free run of the reference
engines with the same inputs. Long variant: ROLLOUT_FLEET_CHAOS_LONG=1 (60 sessions x 100 steps)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker import FleetClient, Session
from broker.redis.embedded import RedisServer, free_port
from schemas.errors import ErrorCode
from schemas.messages import StepResult, TokenStep, WorldStep
from schemas.reference_tokenizer import ReferenceTokenizer
from tests.procs import Fleet
from tests.support import image, world_step
from workers.engines.base import EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
LONG = os.environ.get("ROLLOUT_FLEET_CHAOS_LONG") == "1"
SHAPE = (1, 4, 2, 8, 10)
STAGED_SHAPE = (1, 16, 2, 16, 20)  # 40 KiB of float32: over STAGE_BYTES, so staged (and served in one hop)
TOK = ReferenceTokenizer()


@pytest.fixture
def fleet_procs(redis_server: RedisServer, prefix: str) -> Iterator[Fleet]:
    procs = Fleet(redis_server.url, prefix)
    yield procs
    procs.close()


def token_inputs(k: int, i: int) -> dict[str, Any]:
    ids = (TOK.apply_chat_template([{"role": "user", "content": f"episode {k}"}], add_generation_prompt=True)
           if i == 0 else TOK.encode(f" obs {i}"))
    return {"token_ids": ids, "sampling": {"max_tokens": 4, "temperature": 1.0, "seed": k}}


def inputs(mode: str, k: int, i: int, large: bool = False) -> dict[str, Any]:
    if mode != "world_model_env":
        return token_inputs(k, i)
    step = world_step(i, seed=k)
    if large:  # over STAGE_BYTES once encoded: the payload travels staged (broker/redis/inputs.py)
        step["observation"]["images"] = {"observation/exterior_image_1_left": image(k * 1000 + i, h=128, w=128)}
    return step


def fault_free(modes: list[str], steps: int, large: bool = False,
               shape: tuple[int, ...] = SHAPE) -> list[list[Any]]:
    """The same rollouts straight through one engine, one session after another."""
    engine = ReferenceEngine(ReferenceEngineConfig(latent_shape=shape))
    out = []
    for k, mode in enumerate(modes):
        model = "reference-world" if mode == "world_model_env" else "reference-lm"
        rows = []
        for i in range(steps):
            data = inputs(mode, k, i, large)
            step = WorldStep.from_wire(data) if mode == "world_model_env" else TokenStep.from_wire(data)
            [res] = engine.run_direct(model, [EngineRequest(f"s{k}", model, step, reset=i == 0)])
            assert not isinstance(res, BaseException)
            rows.append(res.output)
        out.append(rows)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "video_latent" in b:
        return bool(a["video_latent"].tobytes() == b["video_latent"].tobytes())
    return bool(a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"])


async def drive(session: Session, mode: str, k: int, steps: int, results: list[StepResult],
                large: bool = False) -> None:
    for i in range(steps):
        # generous: under constant kills every failover replays every moved session's history
        results.append(await asyncio.wait_for(session.step(i, **inputs(mode, k, i, large)), 600))


# Kills also land at these fractions of the run's steps, so a run faster than ``every_s`` still
# sees its chaos: each kill stalls the moved sessions for about a lease, so the run cannot end first.
KILL_AT = (0.15, 0.4, 0.65)


async def killer(procs: Fleet, stop: asyncio.Event, every_s: float, engine_args: list[str],
                 progress: Callable[[], float]) -> int:
    kills = 0
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    last = loop.time()
    marks = list(KILL_AT)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
            break
        except TimeoutError:
            pass
        due = loop.time() - last >= every_s or (marks and progress() >= marks[0])
        victims = procs.alive_workers()
        if not due or not victims:
            continue
        while marks and progress() >= marks[0]:
            marks.pop(0)
        rng.choice(victims).kill()  # SIGKILL: no drain, no handover
        kills += 1
        last = loop.time()
        procs.worker(*engine_args, engine="reference")  # a replacement, as an autoscaler would
    return kills


async def test_sigkill_chaos_loses_nothing_and_matches_a_fault_free_run(fleet_procs: Fleet) -> None:
    fleet_procs.supervisor()
    await sigkill_chaos(fleet_procs, *((60, 100) if LONG else (12, 40)), every_s=5.0 if LONG else 1.5)


async def test_sigkill_chaos_with_the_supervisor_stopped_heals_through_the_workers(fleet_procs: Fleet) -> None:
    supervisor = fleet_procs.supervisor()
    supervisor.send_signal(signal.SIGSTOP)  # frozen for the whole run: only the workers reap
    # a kill every 4 s: each replacement (a torch import) is up before the next kill on a busy machine
    await sigkill_chaos(fleet_procs, 8, 24, every_s=4.0)
    assert supervisor.poll() is None


async def test_sigkill_chaos_with_staged_observations_loses_nothing(fleet_procs: Fleet) -> None:
    """The same chaos with every world observation staged outside the scripts (128x128 images): the
    inputs failover moves with their entries and the record blobs new owners replay all hold, and
    no input blob outlives its step."""
    fleet_procs.supervisor()
    await sigkill_chaos(fleet_procs, 8, 24, every_s=1.5, large=True)


async def test_sigkill_chaos_with_results_in_one_hop_loses_nothing(fleet_procs: Fleet) -> None:
    """The same chaos with latents large enough to be staged and workers that hand them to the
    trainer themselves (--serve-results): a worker killed after its commit leaves its result to
    Redis, and every result still equals the fault-free run's."""
    fleet_procs.supervisor()
    fetched = await sigkill_chaos(fleet_procs, 8, 24, every_s=1.5, shape=STAGED_SHAPE,
                                  extra=["--serve-results", "127.0.0.1:0"])
    assert fetched > 0, "no result came from its worker"


async def sigkill_chaos(fleet_procs: Fleet, sessions_n: int, steps: int, *, every_s: float,
                        large: bool = False, shape: tuple[int, ...] = SHAPE, extra: list[str] | None = None) -> int:
    """Drive ``sessions_n`` sessions while workers are SIGKILLed and replaced; compare every result
    with a fault-free run. ``large``: world observations big enough to be staged; ``shape``: the
    world latent; ``extra``: more worker flags. Returns how many results the client fetched from
    their workers directly."""
    engine_args = ["--latent-shape", ",".join(map(str, shape)), *(extra or [])]
    for _ in range(3):
        fleet_procs.worker(*engine_args, engine="reference")
    await fleet_procs.wait_active(3)
    modes = ["world_model_env" if k % 2 == 0 else "tokens" for k in range(sessions_n)]
    async with FleetClient(fleet_procs.url, prefix=fleet_procs.prefix) as fleet:
        sessions = [await fleet.create_session(model="reference-world" if m == "world_model_env" else "reference-lm",
                                               mode=m) for m in modes]
        results: list[list[StepResult]] = [[] for _ in sessions]
        stop = asyncio.Event()
        def progress() -> float:
            return sum(map(len, results)) / (sessions_n * steps)

        kill_task = asyncio.create_task(killer(fleet_procs, stop, every_s, engine_args, progress))
        pairs = enumerate(zip(sessions, modes, strict=True))
        await asyncio.gather(*[drive(s, m, k, steps, results[k], large) for k, (s, m) in pairs])
        stop.set()
        kills = await kill_task
        print(f"chaos: {sessions_n} sessions x {steps} steps, {kills} workers SIGKILLed and replaced")
        assert kills >= 2, "the run ended before the chaos started"
        assert await fleet.redis.xlen(fleet.keys.dead) == 0  # nothing was dead-lettered on the way
        expected = await asyncio.to_thread(fault_free, modes, steps, large, shape)
        for k, s in enumerate(sessions):
            assert [r.error for r in results[k] if not r.ok] == []  # the trainer saw at most a delay
            assert [r.step_id for r in results[k]] == list(range(steps))  # nothing lost
            assert (await s.status()).committed_step_id == steps - 1  # nothing committed twice or skipped
            mismatched = [i for i, r in enumerate(results[k]) if not same(dict(r.output or {}), expected[k][i])]
            assert mismatched == [], f"session {k} ({modes[k]}) differs at steps {mismatched}"
        staged = [key async for key in fleet.redis.scan_iter(match=fleet.keys.log("*") + ":in:*")]
        assert staged == []  # every step ended, and its input blob with it (moved to its record)
        if large:
            records = [key async for key in fleet.redis.scan_iter(match=fleet.keys.log("*") + ":inrec:*")]
            assert len(records) == modes.count("world_model_env") * steps
        direct = fleet.link(fleet.keys.cell).replies.direct
        return direct.fetched if direct is not None else 0


async def test_a_zombie_worker_cannot_commit_after_failover(fleet_procs: Fleet) -> None:
    fleet_procs.supervisor()
    zombie = fleet_procs.worker("--engine-opt", "delay_ms=300")
    [zid] = await fleet_procs.wait_active(1)
    async with FleetClient(fleet_procs.url, prefix=fleet_procs.prefix) as fleet:
        sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(4)]
        fleet_procs.worker()
        await fleet_procs.wait_active(2)
        futs = [[s.submit(i, **world_step(i)) for i in range(6)] for s in sessions]
        await asyncio.sleep(0.15)  # the zombie is inside the engine with a batch
        zombie.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3 * fleet_procs.lease_ms / 1000)  # past the lease: failover happens
        zombie.send_signal(signal.SIGCONT)
        for s, fs in zip(sessions, futs, strict=True):
            results = await asyncio.wait_for(asyncio.gather(*fs), 30)
            assert all(r.ok for r in results), [r.error for r in results]
            # the null engine counts the steps its context saw: each ran once, in order, on the new owner
            assert [r.output["context"] for r in results] == list(range(6))
            assert all(r.worker_id != zid for r in results)
            status = await s.status()
            assert status.committed_step_id == 5 and status.epoch == 2
        live = await fleet_procs.wait_active(2)  # the zombie came back as a new incarnation
        assert zid not in live and zombie.poll() is None


async def test_sigterm_drains_a_worker_and_its_sessions_continue_elsewhere(fleet_procs: Fleet) -> None:
    first = fleet_procs.worker("--engine-opt", "delay_ms=20")
    await fleet_procs.wait_active(1)
    async with FleetClient(fleet_procs.url, prefix=fleet_procs.prefix) as fleet:
        sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(6)]
        fleet_procs.worker()
        await fleet_procs.wait_active(2)
        results: list[list[StepResult]] = [[] for _ in sessions]
        running = asyncio.gather(*[drive_null(s, 40, results[k]) for k, s in enumerate(sessions)])
        await asyncio.sleep(0.3)
        first.send_signal(signal.SIGTERM)
        await asyncio.wait_for(running, 60)
        assert await asyncio.to_thread(first.wait, 30) == 0
        for rs in results:
            assert all(r.ok for r in rs), [r.error for r in rs if not r.ok]
            assert [r.output["context"] for r in rs] == list(range(40))


async def drive_null(session: Session, steps: int, results: list[StepResult]) -> None:
    for i in range(steps):
        results.append(await asyncio.wait_for(session.step(i, **world_step(i)), 30))


async def test_redis_killed_and_restarted_with_aof_always_loses_nothing(prefix: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rf-aof-") as data:
        port = free_port()
        server = RedisServer(port=port, directory=data, appendonly=True, appendfsync="always").start()
        procs = Fleet(server.url, prefix, lease_ms=10_000, heartbeat_ms=500)
        try:
            for _ in range(2):
                procs.worker("--engine-opt", "delay_ms=5")
            await procs.wait_active(2)
            async with FleetClient(server.url, prefix=prefix) as fleet:
                sessions = [await fleet.create_session(model="null-world", mode="world_model_env")
                            for _ in range(6)]
                results: list[list[StepResult]] = [[] for _ in sessions]
                running = asyncio.gather(*[drive_null(s, 60, results[k]) for k, s in enumerate(sessions)])
                await asyncio.sleep(0.5)
                server.stop(kill=True)  # SIGKILL mid-run
                await asyncio.sleep(1.0)
                server = RedisServer(port=port, directory=data, appendonly=True, appendfsync="always").start()
                await asyncio.wait_for(running, 90)
                for s, rs in zip(sessions, results, strict=True):
                    assert all(r.ok for r in rs), [r.error for r in rs if not r.ok]
                    assert [r.output["context"] for r in rs] == list(range(60))
                    assert (await s.status()).committed_step_id == 59
        finally:
            procs.close()
            server.cleanup()


async def test_redis_restarted_without_persistence_no_trainer_hangs(prefix: str) -> None:
    port = free_port()
    server = RedisServer(port=port).start()
    procs = Fleet(server.url, prefix, lease_ms=2000, heartbeat_ms=300)
    try:
        supervisor = procs.supervisor()
        for _ in range(2):
            procs.worker("--engine-opt", "delay_ms=5")
        await procs.wait_active(2)
        async with FleetClient(server.url, prefix=prefix, step_timeout=30, session_check_s=1.0) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(16)]
            results: list[list[StepResult]] = [[] for _ in sessions]
            running = asyncio.gather(*[drive_null(s, 200, results[k]) for k, s in enumerate(sessions)])
            await asyncio.sleep(1.0)
            server.stop(kill=True)  # SIGKILL mid-run; it comes back empty
            server.cleanup()
            await asyncio.sleep(1.0)
            server = RedisServer(port=port).start()
            await asyncio.wait_for(running, 120)  # every trainer finishes: nobody hangs
            for rs in results:
                ok = [r for r in rs if r.ok]
                assert ok, "the run ended before the restart"
                # what was answered before the loss is each session's steps in order, once each
                assert [r.output["context"] for r in ok] == list(range(len(ok)))
                codes = {r.error.code for r in rs if r.error is not None}
                assert codes <= {ErrorCode.SESSION_NOT_FOUND, ErrorCode.CONTEXT_LOST}, codes
                assert rs[-1].error is not None  # the trainer learnt that its session is gone
            await procs.wait_active(2)  # the workers came back as new incarnations
            fresh = await fleet.create_session(model="null-world", mode="world_model_env")
            assert (await asyncio.wait_for(fresh.step(0, **world_step(0)), 30)).ok
            assert supervisor.poll() is None  # the supervisor rode out the loss
    finally:
        procs.close()
        server.cleanup()
