"""Large results in one hop between hosts (network namespaces, bench/netns.py): a worker on a host of
its own listens on every address with a free port and advertises its host's address
(``--serve-results 0.0.0.0:0 --results-advertise HOST``); the trainer, on another host, takes every
large result from it across the bridge. Cut half-open from the trainer (iptables DROP: no answer,
no reset) while the worker still reaches Redis, every step is still answered, from Redis, the
fetch giving up at its bound instead of waiting on TCP; healed, the trainer fetches from the worker
again once its retry-after has passed. The bounds below only stop a hung test."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from bench.partition import HEARTBEAT_MS, LEASE_MS, Lab
from broker import FleetClient
from broker.client.direct import DirectFetcher
from broker.client.session import Session
from cli import processes
from schemas.results_wire import parse_address
from tests.support import world_step

pytestmark = [pytest.mark.asyncio, pytest.mark.faults, pytest.mark.timeout(300)]
LATENT = (1, 16, 2, 44, 80)  # 450,560 float32 bytes: staged, so served in one hop
BOUND_S = 60.0  # a round of steps within this, or the test fails: far above the fetch's 2 s
SESSIONS = 4


async def step_all(sessions: Sequence[Session], step: int) -> None:
    """One step of every session, each the session's own next one: the null engine's latent is its
    context count, so a lost, doubled or foreign result shows."""
    results = await asyncio.wait_for(asyncio.gather(*(s.step(step, **world_step(step)) for s in sessions)), BOUND_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for result in results:
        assert result.output["context"] == step
        latent = np.asarray(result.output["video_latent"])
        assert latent.shape == LATENT and bool(np.all(latent == step))


async def test_one_hop_across_hosts_rides_out_a_half_open_worker(partition_lab: Lab) -> None:
    lab = partition_lab
    host = lab.net.host("worker")
    lab.spawn(host, processes.worker_command(
        lab.url, lab.prefix, engine="null", engine_options={"latent_shape": list(LATENT)},
        heartbeat_ms=HEARTBEAT_MS, lease_ms=LEASE_MS,
        extra=["--serve-results", "0.0.0.0:0", "--results-advertise", host.ip]))
    await lab.workers(1)
    async with FleetClient(lab.url, prefix=lab.prefix) as fleet:
        sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(SESSIONS)]
        raw = await fleet.redis.hget(fleet.keys.worker(sessions[0].owner), "results_at")
        assert raw is not None
        advertised_host, port = parse_address(raw.decode())
        assert advertised_host == host.ip and port != 0  # its host's address, the port it got
        direct = fleet.link(fleet.keys.cell).replies.direct
        assert isinstance(direct, DirectFetcher)
        for step in range(3):
            await step_all(sessions, step)
        assert (direct.fetched, direct.missed) == (3 * SESSIONS, 0)  # every result across the bridge

        lab.net.cut(lab.net.root_ip, host)  # trainer and worker: half-open; both still reach Redis
        try:
            for step in range(3, 6):
                await step_all(sessions, step)
        finally:
            lab.net.heal(lab.net.root_ip, host)
        assert direct.fetched == 3 * SESSIONS and direct.missed >= 1  # from Redis, none lost

        step = 6
        while direct.fetched == 3 * SESSIONS:  # after the retry-after, from the worker again
            assert step < 6 + int(BOUND_S / 0.5), "the trainer never fetched from the healed worker again"
            await step_all(sessions, step)
            step += 1
            await asyncio.sleep(0.5)
