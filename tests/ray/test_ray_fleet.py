"""The fleet's workers on a real local Ray cluster of several nodes: ``up`` places them, trainers
step through them, a node is lost mid-run (its workers' sessions fail over, Ray restarts the
actors on a live node, nothing is lost or doubled), ``scale`` up and down drains, ``down`` leaves
no worker, no actor and no placement group behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from broker import FleetClient
from broker.client.session import Session
from broker.redis.config import CellConfig
from schemas.results_wire import parse_address
from tests.ray.conftest import HEARTBEAT, NODE, fleet_actors, fleet_groups
from tests.support import world_step
from workers.ray_fleet import FleetSpec, RayFleet, RayFleetError, live_in_cell, wait_live, worker_env

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300, func_only=True)]
STEPS = 24
LATENT = (1, 16, 2, 44, 80)  # 450,560 float32 bytes: a large result, staged and served in one hop
STEP_DELAY = {"delay_ms": 40}  # null engine: each batch takes this long, so steps are in flight when a node goes


def spec(cell: CellConfig, placement: str = "pack") -> FleetSpec:
    env = worker_env(cell, "null", engine_options=STEP_DELAY, drain_timeout_s=20, extra=HEARTBEAT)
    return FleetSpec(worker_env=env, placement=placement, drain_timeout_s=20)  # type: ignore[arg-type]


async def open_sessions(client: FleetClient, count: int) -> list[Session]:
    return [await client.create_session(model="null-world", mode="world_model_env") for _ in range(count)]


async def run_steps(sessions: Sequence[Session], steps: range) -> None:
    """Pipeline ``steps`` of every session; each result must be the session's own next step: the
    null engine's ``context`` counts the steps a session's context has seen, so a lost step, a
    step run twice or out of order shows as a wrong count."""
    futures = [[s.submit(i, **world_step(i)) for i in steps] for s in sessions]
    for session, fs in zip(sessions, futures, strict=True):
        results = await asyncio.wait_for(asyncio.gather(*fs), 120)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert [r.output["context"] for r in results] == list(steps), session.session_id
        assert (await session.status()).committed_step_id == steps[-1]


def by_index(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {row["index"]: row for row in rows}


async def test_up_places_workers_that_serve_steps_and_down_leaves_nothing(ray_cluster: Any, cell: CellConfig) -> None:
    fleet = RayFleet("t-up")
    report = await asyncio.to_thread(fleet.up, spec(cell), 2)
    assert sorted(by_index(report.workers)) == [0, 1]
    await wait_live(cell, fleet, 2, 90)
    async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
        sessions = await open_sessions(client, 4)
        assert {s.owner for s in sessions} <= set(report.worker_ids)
        await run_steps(sessions, range(6))
    assert len(fleet_actors("t-up")) == 3  # the controller and two workers
    outcome = await asyncio.to_thread(fleet.down)
    assert outcome == {0: 0, 1: 0}  # each worker drained and exited 0
    assert fleet_actors("t-up") == [] and fleet_groups("t-up") == []
    assert await live_in_cell(cell, report.worker_ids) == set()


async def test_a_lost_node_moves_its_sessions_and_ray_restarts_its_workers(ray_cluster: Any, cell: CellConfig) -> None:
    doomed = ray_cluster.add_node(**NODE)
    ray_cluster.wait_for_nodes()
    fleet = RayFleet("t-node")
    report = await asyncio.to_thread(fleet.up, spec(cell, "spread"), 3)
    await wait_live(cell, fleet, 3, 90)
    lost = {row["index"]: row["worker_id"] for row in report.workers if row["node_id"] == doomed.node_id}
    assert lost, "SPREAD put no worker on the third node"
    try:
        async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
            sessions = await open_sessions(client, 6)
            assert {s.owner for s in sessions} & set(lost.values()), "no session on the doomed node's workers"
            steps = asyncio.ensure_future(run_steps(sessions, range(STEPS)))
            await asyncio.sleep(0.3)  # steps are in flight on every worker
            await asyncio.to_thread(ray_cluster.remove_node, doomed, False)  # the node is gone, not drained
            await steps  # every step committed once, in order, on its session's owner of the moment
            # The lost workers' processes die with their actors, which notice the raylet's end on
            # their own time: a lost worker may have served all its steps first. Its sessions move
            # once its lease runs out, whatever it had served.
            await wait_moved(sessions, set(lost.values()))
            await wait_restarted(fleet, cell, lost, doomed.node_id)
            await run_steps(sessions, range(STEPS, STEPS + 4))  # and the fleet serves on
    finally:
        await asyncio.to_thread(fleet.down)
    assert fleet_actors("t-node") == [] and fleet_groups("t-node") == []


async def wait_moved(sessions: Sequence[Session], lost: set[str], timeout_s: float = 60.0) -> None:
    """No session belongs to a lost worker any more: their leases ran out and they failed over."""
    deadline = time.monotonic() + timeout_s
    while True:
        stuck = [s.session_id for s in sessions if (await s.status()).owner in lost]
        if not stuck:
            return
        assert time.monotonic() < deadline, f"sessions still belong to a worker of the lost node: {stuck}"
        await asyncio.sleep(0.2)


async def wait_restarted(fleet: RayFleet, cell: CellConfig, lost: dict[int, str], dead_node: str) -> None:
    """Ray restarts each lost worker's actor on a live node, with a fresh worker live in the cell."""
    deadline = time.monotonic() + 120
    while True:
        rows = by_index((await asyncio.to_thread(fleet.status)).workers)
        back = [rows[i] for i in lost if rows[i].get("reachable") and rows[i].get("running")]
        if len(back) == len(lost):
            assert all(r["restarted"] and r["node_id"] != dead_node for r in back), back
            assert not {r["worker_id"] for r in back} & set(lost.values())  # a new incarnation each
            if await live_in_cell(cell, [r["worker_id"] for r in back]) == {r["worker_id"] for r in back}:
                return
        assert time.monotonic() < deadline, f"the lost workers did not come back: {rows}"
        await asyncio.sleep(0.5)


async def test_workers_on_ray_hand_large_results_to_their_trainer_in_one_hop(ray_cluster: Any,
                                                                            cell: CellConfig) -> None:
    """``up`` with serve_results 0.0.0.0:0: each worker listens on a free port of its node and
    advertises its node's address with it; a trainer takes every large result from the worker that
    committed it, Redis none."""
    import ray

    env = worker_env(cell, "null", engine_options={"latent_shape": list(LATENT)}, drain_timeout_s=20,
                     serve_results="0.0.0.0:0", extra=HEARTBEAT)
    fleet = RayFleet("t-one-hop")
    report = await asyncio.to_thread(fleet.up, FleetSpec(worker_env=env, drain_timeout_s=20), 2)
    try:
        await wait_live(cell, fleet, 2, 90)
        node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
            advertised = set()
            for row in report.workers:
                raw = await client.redis.hget(client.keys.worker(row["worker_id"]), "results_at")
                assert raw is not None, f"worker {row['index']} does not say where it serves results"
                host, port = parse_address(raw.decode())
                assert host == node_ips[row["node_id"]] and port != 0
                advertised.add((host, port))
            assert len(advertised) == 2  # two workers, a port each
            sessions = await open_sessions(client, 4)
            assert len({s.owner for s in sessions}) == 2
            await run_steps(sessions, range(3))
            direct = client.link(client.keys.cell).replies.direct
            assert direct is not None and (direct.fetched, direct.missed) == (12, 0)
    finally:
        await asyncio.to_thread(fleet.down)
    assert fleet_actors("t-one-hop") == [] and fleet_groups("t-one-hop") == []


async def test_scale_up_then_down_drains_while_steps_run(ray_cluster: Any, cell: CellConfig) -> None:
    fleet = RayFleet("t-scale")
    await asyncio.to_thread(fleet.up, spec(cell), 1)
    try:
        report = await asyncio.to_thread(fleet.scale, 3)
        assert sorted(by_index(report.workers)) == [0, 1, 2]
        await wait_live(cell, fleet, 3, 90)
        async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
            sessions = await open_sessions(client, 6)
            stopped = {row["worker_id"] for row in report.workers if row["index"] in (1, 2)}
            assert {s.owner for s in sessions} & stopped, "no session on the workers scale will stop"
            steps = asyncio.ensure_future(run_steps(sessions, range(STEPS)))
            await asyncio.sleep(0.3)
            report = await asyncio.to_thread(fleet.scale, 1)  # drains workers 1 and 2 under load
            assert sorted(by_index(report.workers)) == [0]
            await steps
            assert {(await s.status()).owner for s in sessions} == set(report.worker_ids)
            assert await live_in_cell(cell, stopped) == set()
        assert len(fleet_actors("t-scale")) == 2 and len(fleet_groups("t-scale")) == 1
    finally:
        await asyncio.to_thread(fleet.down)
    assert fleet_actors("t-scale") == [] and fleet_groups("t-scale") == []


async def test_up_refuses_what_the_cluster_cannot_place_and_leaves_nothing(ray_cluster: Any,
                                                                          cell: CellConfig) -> None:
    fleet = RayFleet("t-nogpu")
    no_room = FleetSpec(worker_env=worker_env(cell, "null"), num_gpus=1, place_timeout_s=3)
    with pytest.raises(RayFleetError, match="could not place 1 x"):
        await asyncio.to_thread(fleet.up, no_room, 1)
    assert fleet_actors("t-nogpu") == [] and fleet_groups("t-nogpu") == []
    with pytest.raises(RayFleetError, match="no fleet named 't-nogpu'"):
        await asyncio.to_thread(fleet.status)


async def test_a_restarted_controller_finds_its_workers_by_their_names(ray_cluster: Any, cell: CellConfig) -> None:
    import ray

    from workers.ray_fleet import NAMESPACE

    fleet = RayFleet("t-ctl")
    before = await asyncio.to_thread(fleet.up, spec(cell), 2)
    try:
        controller = ray.get_actor("t-ctl", namespace=NAMESPACE)
        ray.kill(controller, no_restart=False)  # as when its node is lost: Ray restarts it, its memory is gone
        deadline = time.monotonic() + 60
        while True:
            try:
                after = await asyncio.to_thread(fleet.status)
                break
            except RayFleetError:  # restarting: the call fails until it is back
                assert time.monotonic() < deadline, "the controller did not come back"
                await asyncio.sleep(0.5)
        assert [w["worker_id"] for w in after.workers] == [w["worker_id"] for w in before.workers]
        report = await asyncio.to_thread(fleet.scale, 1)  # and it still scales what it found
        assert sorted(by_index(report.workers)) == [0] and len(fleet_groups("t-ctl")) == 1
    finally:
        await asyncio.to_thread(fleet.down)
    assert fleet_actors("t-ctl") == [] and fleet_groups("t-ctl") == []


async def wait_count(fleet: RayFleet, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len((await asyncio.to_thread(fleet.status)).workers) != count:
        assert time.monotonic() < deadline, f"the fleet did not reach {count} workers"
        await asyncio.sleep(0.5)


async def test_the_autoscaler_follows_the_sessions(ray_cluster: Any, cell: CellConfig) -> None:
    from workers.ray_fleet import Autoscale

    env = worker_env(cell, "null", drain_timeout_s=20, extra={**HEARTBEAT, "ROLLOUT_FLEET_CAPACITY": "2"})
    policy = Autoscale(min_workers=1, max_workers=3, target_fill=0.5, interval_s=1, down_after=2)
    fleet = RayFleet("t-auto")
    await asyncio.to_thread(fleet.up, FleetSpec(worker_env=env, drain_timeout_s=20, autoscale=policy), 1)
    try:
        await wait_live(cell, fleet, 1, 90)
        async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
            sessions = await open_sessions(client, 2)  # 2 sessions / (0.5 x 2) -> 2 workers
            await wait_count(fleet, 2)
            await wait_live(cell, fleet, 2, 90)
            sessions += await open_sessions(client, 2)  # 4 sessions want 4 workers: at most 3
            await wait_count(fleet, 3)
            await wait_live(cell, fleet, 3, 90)
            await run_steps(sessions, range(4))
            for session in sessions:
                await session.close()
            await wait_count(fleet, 1)  # nothing open: back to the floor, drained
    finally:
        await asyncio.to_thread(fleet.down)
    assert fleet_actors("t-auto") == [] and fleet_groups("t-auto") == []


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


async def test_a_killed_worker_process_or_actor_comes_back_and_nothing_is_lost(ray_cluster: Any,
                                                                              cell: CellConfig) -> None:
    import ray

    from workers.ray_fleet import NAMESPACE
    from workers.ray_fleet.spec import worker_name

    fleet = RayFleet("t-kill")
    report = await asyncio.to_thread(fleet.up, spec(cell), 2)
    try:
        await wait_live(cell, fleet, 2, 90)
        first, second = sorted(report.workers, key=lambda row: row["index"])
        async with FleetClient(cell.redis_url, prefix=cell.prefix) as client:
            sessions = await open_sessions(client, 4)
            steps = asyncio.ensure_future(run_steps(sessions, range(STEPS)))
            await asyncio.sleep(0.3)
            os.kill(first["pid"], signal.SIGKILL)  # the worker process alone: its actor must notice
            await steps
            await wait_restarted(fleet, cell, {0: first["worker_id"]}, dead_node="")
            actor = ray.get_actor(worker_name("t-kill", second["group"], second["bundle"], 1), namespace=NAMESPACE)
            ray.kill(actor, no_restart=False)  # the actor alone: its worker must not outlive it
            deadline = time.monotonic() + 30
            while not gone(second["pid"]):
                assert time.monotonic() < deadline, "the worker outlived its actor"
                await asyncio.sleep(0.2)
            await wait_restarted(fleet, cell, {1: second["worker_id"]}, dead_node="")
            await run_steps(sessions, range(STEPS, STEPS + 4))
    finally:
        await asyncio.to_thread(fleet.down)
