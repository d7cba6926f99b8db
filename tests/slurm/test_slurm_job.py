"""docs/deploy/slurm.md's batch script, unchanged, as a job of a real Slurm: one worker per GPU
(two tasks, two GPUs), the Redis URL from the env file, trainers stepping through them (large
results in one hop, each worker on a free port advertised at the node's address); a worker
SIGKILLed mid-run has its sessions failed over and is started again in place by the task's loop;
``scancel`` drains both workers, whose sessions move to a worker outside the job; no step is lost
or run twice (every session's committed step is the last one stepped, every step answered ok)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker import FleetClient
from broker.client.session import Session
from broker.ops.status import cell_status
from broker.redis.embedded import RedisServer, free_port
from schemas.results_wire import parse_address
from tests.procs import Fleet
from tests.slurm.conftest import GPUS, Slurm
from tests.support import world_step
from tests.test_slurm import batch_script

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
WORLD = "null-world"
SESSIONS = 4
STEP_TIMEOUT_S = 60.0
LATENT = (1, 16, 2, 44, 80)  # staged: a large result, served by the worker that committed it
LATENT_OPT = "latent_shape=[" + ",".join(map(str, LATENT)) + "]"  # every worker's (a replay checks the latents)
WAIT_S = 90.0  # a worker process starts in a few seconds on an idle machine; this one is shared


def job_files(slurm: Slurm, redis_url: str, prefix: str) -> tuple[Path, Path]:
    """The batch script as the docs give it, and the env file it reads (mode 600)."""
    script = slurm.root / "rollout-fleet.sbatch"
    script.write_text(batch_script())
    env_file = slurm.root / f"env-{prefix}"
    env_file.touch(mode=0o600)
    env_file.write_text("\n".join([
        f"ROLLOUT_FLEET_REDIS_URL={redis_url}", f"ROLLOUT_FLEET_PREFIX={prefix}",
        # latents of 450 KB, handed to the trainer in one hop from a free port of each worker
        "ROLLOUT_FLEET_ENGINE=null", f"ROLLOUT_FLEET_ENGINE_OPT={LATENT_OPT}",
        "ROLLOUT_FLEET_SERVE_RESULTS=0.0.0.0:0",
        "ROLLOUT_FLEET_HEARTBEAT_MS=200", "ROLLOUT_FLEET_LEASE_MS=1000",
        "ROLLOUT_FLEET_DRAIN_TIMEOUT_S=10", "ROLLOUT_FLEET_REBALANCE_INTERVAL_S=0",  # moves by the drain only
        f"ROLLOUT_FLEET_METRICS_BASE={free_port(count=GPUS)}", ""]))
    return script, env_file


def command_shim(slurm: Slurm) -> Path:
    """``rollout-fleet`` on the job's PATH: this checkout's CLI, as the installed script runs it."""
    bin_dir = slurm.root / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "rollout-fleet"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cli.main "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def submit(slurm: Slurm, redis_url: str, prefix: str) -> tuple[str, Path]:
    script, env_file = job_files(slurm, redis_url, prefix)
    output = slurm.root / f"job-{prefix}.out"
    env = {**slurm.env, "PATH": f"{command_shim(slurm)}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "ROLLOUT_FLEET_ENV_FILE": str(env_file)}
    env.pop("ROLLOUT_FLEET_REDIS_URL", None)  # only the env file gives it
    job = Slurm(slurm.root, env).run(  # the script's own sizes are for a GPU cluster: this node's
        "sbatch", "--parsable", "--nodes=1", f"--ntasks-per-node={GPUS}", "--cpus-per-task=1", "--time=15",
        f"--output={output}", f"--chdir={slurm.root}", str(script)).strip()
    return job, output


async def live_workers(url: str, prefix: str, count: int, not_in: frozenset[str] = frozenset()) -> list[str]:
    """Wait until ``count`` active workers, none of them in ``not_in``, hold live leases."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        report = await cell_status(url, prefix=prefix)
        live = [w.worker_id for w in report.workers
                if w.fields.get("state") == "active" and w.heartbeat_age_ms <= 1000 and w.worker_id not in not_in]
        if len(live) >= count:
            return live
        await asyncio.sleep(0.2)
    raise AssertionError(f"{count} live workers did not show up within {WAIT_S:g}s")


def job_worker_pids(slurm: Slurm, job: str) -> list[int]:
    """The job's worker processes (``scontrol listpids``), by the command line each one runs."""
    pids = []
    for line in slurm.run("scontrol", "listpids", job).splitlines()[1:]:
        pid = int(line.split()[0])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"cli.main" in argv and b"worker" in argv:
            pids.append(pid)
    return pids


async def step_all(sessions: list[Session], step_id: int) -> set[str]:
    """Step every session once; every step answers ok. The workers that answered."""
    results = await asyncio.wait_for(
        asyncio.gather(*(s.step(step_id, **world_step(step_id)) for s in sessions)), STEP_TIMEOUT_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return {r.worker_id for r in results}


async def until_job_gone(slurm: Slurm, job: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while slurm.run("squeue", "-h", "-j", job).strip():
        assert time.monotonic() < deadline, f"job {job} still queued {WAIT_S:g}s after scancel"
        await asyncio.sleep(0.5)


async def test_the_batch_script_runs_heals_and_drains_on_scancel(slurm: Slurm, redis_server: RedisServer,
                                                                  prefix: str) -> None:
    url = redis_server.url
    job, output = submit(slurm, url, prefix)
    outside = Fleet(url, prefix)
    try:
        in_job = await live_workers(url, prefix, GPUS)
        async with FleetClient(url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model=WORLD, mode="world_model_env") for _ in range(SESSIONS)]
            assert await step_all(sessions, 0) <= set(in_job)
            # One hop: each job worker advertises the node's first address and a port of its own,
            # and every result of the first step came from its worker.
            node_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()[0]
            advertised = set()
            for worker_id in in_job:
                raw = await fleet.redis.hget(fleet.keys.worker(worker_id), "results_at")
                assert raw is not None, f"{worker_id} serves no results"
                host, port = parse_address(raw.decode())
                assert host == node_ip and port != 0
                advertised.add(port)
            assert len(advertised) == GPUS
            direct = fleet.link(fleet.keys.cell).replies.direct
            assert direct is not None and direct.fetched == SESSIONS
            # A crash: SIGKILL one worker; its sessions fail over, and its task starts it again.
            pids = job_worker_pids(slurm, job)
            assert len(pids) == GPUS, pids
            os.kill(pids[0], 9)
            assert await step_all(sessions, 1) <= set(in_job)
            restarted = await live_workers(url, prefix, 1, not_in=frozenset(in_job))
            assert len(job_worker_pids(slurm, job)) == GPUS
            # A worker outside the job, then scancel: both job workers drain, handing their sessions to it.
            outside.worker("--rebalance-interval", "0", "--engine-opt", LATENT_OPT)
            (outsider,) = await live_workers(url, prefix, 1, not_in=frozenset(in_job + restarted))
            slurm.run("scancel", job)
            await until_job_gone(slurm, job)
            assert await step_all(sessions, 2) == {outsider}
            for s in sessions:
                status = await s.status()
                assert (status.owner, status.committed_step_id, status.next_step_id) == (outsider, 2, 3)
    finally:
        outside.close()
        if slurm.run("squeue", "-h", "-j", job).strip():
            slurm.run("scancel", job)
    log = output.read_text()
    assert len(re.findall(r"exited 137; start 1 of 10", log)) == 1, log  # the SIGKILLed one, once
    # scancel signals both job workers at once: one may hand a session to the other before that one
    # has left the placement pools (a few ms), which then hands it on. Every hop is accounted for,
    # and every session reaches the outsider exactly once.
    drainers = set(re.findall(r"worker (\S+) drained: ", log))
    handed = sum(map(int, re.findall(r"drain: handed over (\d+) sessions", log)))
    hops = [to for frm, to in re.findall(r"session \S+: (\S+) -> (\S+) \(epoch", log) if frm in drainers]
    assert len(drainers) == GPUS and len(hops) == handed, log
    assert hops.count(outsider) == SESSIONS and set(hops) <= drainers | {outsider}, log
    assert "REDIS_URL" not in log and url not in log  # the URL came through the environment only
