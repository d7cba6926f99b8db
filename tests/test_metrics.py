"""Prometheus metrics: a worker's /metrics counts exactly the steps it answered (committed,
duplicate, failed by code), its histograms count the same steps, failovers and rebuilds are
counted, no session or worker id becomes a label; the gateway's /metrics sits behind its API key;
a CLI worker process serves /metrics on --metrics-port or $ROLLOUT_FLEET_METRICS_PORT."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
from collections.abc import Iterable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from broker import FleetClient
from broker.gateway.settings import GatewaySettings
from broker.ops.metrics import STEP_BUCKETS, FleetMetrics, StepHistogram
from broker.ops.supervisor import SupervisorSettings, reap_job, trim_job
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from broker.redis.scripts import Scripts
from cli.main import parse_invocation
from cli.processes import supervisor_command, worker_command
from schemas.errors import ErrorCode
from tests.procs import Fleet
from tests.support import FAST, WorkerPool, world_step
from tests.test_gateway import SESSIONS, GatewayServer, body
from workers.engines.null import NullEngine

WORLD = "null-world"


async def scrape(port: int, headers: dict[str, str] | None = None) -> list[Sample]:
    async with httpx.AsyncClient(timeout=10.0) as http:
        r = await http.get(f"http://127.0.0.1:{port}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    # Prometheus's text exposition: version 0.0.4 or 1.0.0 depending on prometheus-client's release.
    assert re.match(r"text/plain; version=(0\.0\.4|1\.0\.0)", r.headers["content-type"]), r.headers["content-type"]
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def value(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The one sample of ``name`` with exactly these labels (0 when the series does not exist yet)."""
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


def label_values(samples: Iterable[Sample]) -> set[str]:
    return {v for s in samples for v in s.labels.values()}


async def test_a_worker_counts_the_steps_it_answered(fleet: FleetClient, workers: WorkerPool,
                                                     scripts: Scripts) -> None:
    engine = NullEngine()
    w = await workers.add(engine, max_attempts=1, metrics_port=0)
    port = w.worker.metrics.bound_port
    assert port is not None
    s = await fleet.create_session(model=WORLD, mode="world_model_env", result_window=8)
    for i in range(5):
        assert (await s.step(i, **world_step(i))).ok
    failed = await s.step(5, **world_step(5, prompt="fail"))
    assert failed.error is not None and failed.error.code is ErrorCode.INFERENCE_ERROR
    invalid = await s.step(5, **world_step(5, prompt="invalid"))
    assert invalid.error is not None and invalid.error.code is ErrorCode.INVALID_REQUEST
    assert (await s.step(2, **world_step(2))).duplicate

    samples = await scrape(port)
    steps = "rollout_fleet_steps_total"
    assert value(samples, steps, model=WORLD, outcome="committed") == 5
    # The re-sent step was answered by enqueue.lua from its stored result: it never reached the worker.
    assert value(samples, steps, model=WORLD, outcome="duplicate") == 0
    assert value(samples, steps, model=WORLD, outcome="inference_error") == 1
    assert value(samples, steps, model=WORLD, outcome="invalid_request") == 1
    for phase in ("queue", "engine", "commit", "total"):
        assert value(samples, "rollout_fleet_step_seconds_count", model=WORLD, phase=phase) == 5, phase
    assert value(samples, "rollout_fleet_step_seconds_sum", model=WORLD, phase="total") > 0
    # Every engine call is one observed batch, failed ones included.
    assert value(samples, "rollout_fleet_batch_size_count", model=WORLD) == len(engine.batch_sizes)
    assert value(samples, "rollout_fleet_batch_size_sum", model=WORLD) == sum(engine.batch_sizes)
    # The inference error was dead-lettered (its last attempt); an invalid request is not.
    assert value(samples, "rollout_fleet_dead_letters_total") == 1
    assert await scripts.redis.xlen(scripts.keys.dead) == 1
    assert value(samples, "rollout_fleet_sessions", model=WORLD) == 1
    assert value(samples, "rollout_fleet_sessions", model="null-lm") == 0
    assert value(samples, "rollout_fleet_policy_version", model=WORLD) == 0
    assert value(samples, "rollout_fleet_engine_ready") == 1
    assert value(samples, "rollout_fleet_inbox_pending") == 0
    assert value(samples, "rollout_fleet_failovers_total") == 0
    assert not label_values(samples) & {s.session_id, w.id}

    await s.close()  # the worker applies the close after close() returns: wait for it, bounded
    deadline = time.monotonic() + 10.0
    while value(await scrape(port), "rollout_fleet_sessions", model=WORLD) != 0:
        assert time.monotonic() < deadline, "the sessions gauge still counts the closed session"
        await asyncio.sleep(0.05)


async def test_failovers_and_context_rebuilds_are_counted(fleet: FleetClient, workers: WorkerPool) -> None:
    fast = {"heartbeat_ms": FAST["heartbeat_ms"], "lease_ms": FAST["lease_ms"]}
    first = await workers.add(NullEngine(), **fast)
    s = await fleet.create_session(model=WORLD, mode="world_model_env")
    for i in range(3):
        assert (await s.step(i, **world_step(i))).ok
    heir = await workers.add(NullEngine(), metrics_port=0, **fast)
    await workers.kill(first)
    port = heir.worker.metrics.bound_port
    assert port is not None
    deadline = time.monotonic() + 10.0
    while value(await scrape(port), "rollout_fleet_failovers_total") < 1:
        assert time.monotonic() < deadline, "the surviving worker did not reap the dead one"
        await asyncio.sleep(0.1)
    assert (await s.step(3, **world_step(3))).ok  # the new owner rebuilds the context first
    samples = await scrape(port)
    assert value(samples, "rollout_fleet_failovers_total") == 1
    assert value(samples, "rollout_fleet_context_rebuild_seconds_count") == 1
    assert value(samples, "rollout_fleet_steps_total", model=WORLD, outcome="committed") == 1


async def test_the_gateway_serves_metrics_behind_its_key(redis_server: RedisServer, prefix: str,
                                                         workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    settings = GatewaySettings(api_keys=frozenset({"alpha-key"}))
    key = {"Authorization": "Bearer alpha-key"}
    async with GatewayServer(redis_server.url, prefix, settings=settings, model_default=WORLD) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        assert (await http.get("/metrics")).status_code == 401
        r = await http.post(SESSIONS, json={"model": WORLD}, headers=key)
        sid = r.json()["session_id"]
        for i in (0, 1, 2, 1):
            assert (await http.post(f"{SESSIONS}/{sid}/step", json=body(i), headers=key)).status_code == 200
        port = int(server.url.rsplit(":", 1)[1])
        samples = await scrape(port, headers=key)
    assert value(samples, "rollout_fleet_steps_total", model=WORLD, outcome="committed") == 3
    assert value(samples, "rollout_fleet_steps_total", model=WORLD, outcome="duplicate") == 1
    assert value(samples, "rollout_fleet_step_seconds_count", model=WORLD, phase="total") == 4
    assert sid not in label_values(samples)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_worker_process_serves_metrics_on_its_port(redis_server: RedisServer, prefix: str,
                                                           fleet: FleetClient) -> None:
    port = free_port()
    procs = Fleet(redis_server.url, prefix)
    try:
        procs.worker("--metrics-port", str(port))
        await procs.wait_active(1)
        s = await fleet.create_session(model=WORLD, mode="world_model_env")
        for i in range(2):
            assert (await s.step(i, **world_step(i))).ok
        samples = await scrape(port)
    finally:
        procs.close()
    assert value(samples, "rollout_fleet_steps_total", model=WORLD, outcome="committed") == 2
    assert value(samples, "rollout_fleet_engine_ready") == 1


def test_the_metrics_port_flag_reads_the_environment_and_refuses_bad_ports(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ROLLOUT_FLEET_METRICS_PORT": "9400"}
    for verb in ("worker", "supervisor"):
        assert parse_invocation([verb], {}).args.metrics_port is None  # off unless asked for
        assert parse_invocation([verb], env).args.metrics_port == 9400
        assert parse_invocation([verb, "--metrics-port", "9500"], env).args.metrics_port == 9500
    for bad_env, argv, named in (({}, ["worker", "--metrics-port", "70000"], "--metrics-port"),
                                 ({"ROLLOUT_FLEET_METRICS_PORT": "nine"}, ["worker"], "ROLLOUT_FLEET_METRICS_PORT")):
        with pytest.raises(SystemExit) as exit_info:
            parse_invocation(argv, bad_env)
        assert exit_info.value.code == 2
        assert named in capsys.readouterr().err


async def test_the_supervisor_counts_failovers_dead_letters_and_sessions(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts, redis_server: RedisServer, prefix: str) -> None:
    fast = {"heartbeat_ms": FAST["heartbeat_ms"], "lease_ms": FAST["lease_ms"], "reap": False}
    config = CellConfig(redis_url=redis_server.url, prefix=prefix, lease_ms=FAST["lease_ms"])
    metrics = FleetMetrics()
    ctx: dict[str, Any] = {"settings": SupervisorSettings(cell_config=config), "fleet_redis": scripts.redis,
                           "metrics": metrics}
    for _ in range(2):
        await workers.add(NullEngine(), max_attempts=1, **fast)
    s = await fleet.create_session(model=WORLD, mode="world_model_env")
    await reap_job(ctx)  # the first pass takes the dead-letter stream as it is (none yet)
    assert not (await s.step(0, **world_step(0, prompt="fail"))).ok  # dead-lettered
    assert (await s.step(0, **world_step(0))).ok
    await workers.kill(next(w for w in workers.running if w.id == s.owner))
    deadline = time.monotonic() + 10.0
    while metrics.registry.get_sample_value("rollout_fleet_failovers_total") != 1:
        assert time.monotonic() < deadline, "the supervisor did not fail the session over"
        await asyncio.sleep(0.1)
        await reap_job(ctx)
    assert metrics.registry.get_sample_value("rollout_fleet_dead_letters_total") == 1
    await trim_job(ctx)
    assert metrics.registry.get_sample_value("rollout_fleet_sessions", {"model": WORLD}) == 1


async def test_a_supervisor_process_serves_metrics_and_a_taken_port_is_one_line(
        redis_server: RedisServer, prefix: str) -> None:
    port = free_port()
    command = [*supervisor_command(redis_server.url, prefix), "--metrics-port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                samples = await scrape(port)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "no /metrics from the supervisor"
                await asyncio.sleep(0.1)
        assert value(samples, "rollout_fleet_failovers_total") == 0
        # The port is taken now: a worker asked to serve metrics there says so and exits 2.
        taken = subprocess.run(worker_command(redis_server.url, prefix, extra=["--metrics-port", str(port)]),
                               capture_output=True, text=True, timeout=60)
        assert taken.returncode == 2
        assert taken.stderr.strip().splitlines() == [
            f"worker: cannot serve metrics on 0.0.0.0:{port}: Address already in use"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_step_histogram_reads_as_prometheus_clients_histogram() -> None:
    """StepHistogram (the step path's cheap observe) exposes what prometheus-client's Histogram
    exposes for the same observations: every bucket, count and sum, a value on a bound in that
    bucket, a NaN in none; only the _created timestamps differ."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = StepHistogram("t_seconds", "doc", ("model", "phase"), STEP_BUCKETS, registry=ours)
    slow = Histogram("t_seconds", "doc", ["model", "phase"], buckets=STEP_BUCKETS, registry=theirs)
    values = [*STEP_BUCKETS, 0.0, -1.0, 1e-9, 0.0007, 3.0, 299.9, 301.0, 1e12, float("nan")]
    for i, v in enumerate(values):
        labels = ("m", "queue" if i % 3 else "total")
        fast.labels(*labels).observe(v)
        slow.labels(*labels).observe(v)

    def text(registry: CollectorRegistry) -> str:
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())

    assert "t_seconds_bucket" in text(ours) and text(ours) == text(theirs)
    with pytest.raises(ValueError):
        fast.labels("m")
    with pytest.raises(ValueError):
        StepHistogram("u_seconds", "doc", ("model",), (1.0, 0.5), registry=CollectorRegistry())
