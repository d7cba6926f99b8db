"""The CLI as a user runs it: the demo (the README's main job), the embedded Redis, status."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import redis

from broker.redis.embedded import RedisServer, free_port

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "cli.main"]


def test_demo_runs_both_modes_and_reports_no_loss() -> None:
    out = subprocess.run([*CLI, "demo", "--sessions", "4", "--steps", "6", "--no-progress",
                          "--latent-shape", "1,4,2,8,10"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"committed=(\d+) failed=(\d+) lost=(\d+) steps/s=[\d.]+ p50_ms=[\d.]+ p99_ms=[\d.]+", last)
    assert m, last
    assert m.groups() == ("24", "0", "0")


def test_demo_heals_a_killed_worker_and_exposes_its_metrics() -> None:
    port = free_port(count=2)  # the demo's two workers serve metrics on port and port + 1
    out = subprocess.run([*CLI, "demo", "--sessions", "6", "--steps", "30", "--no-progress", "--kill-one",
                          "--metrics-port", str(port), "--latent-shape", "1,4,2,8,10"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("committed=180 failed=0 lost=0 "), lines[-1]
    assert any(line.startswith("killed worker process") for line in lines), lines
    [survivor] = [line for line in lines if line.startswith("metrics of worker 1 ")]
    m = re.search(r"committed\}=(\d+) rollout_fleet_failovers_total=(\d+)", survivor)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) >= 1, survivor  # it took the dead worker's sessions


def test_demo_exits_non_zero_when_steps_fail() -> None:
    # a capacity of 1 session per worker cannot place 4 sessions: the demo must not report success
    out = subprocess.run([*CLI, "demo", "--engine", "null", "--workers", "1", "--sessions", "3", "--steps", "2",
                          "--no-progress", "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_redis_command_serves_until_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen([*CLI, "redis", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "redis listening" in proc.stdout.readline()
        with redis.Redis(port=port) as client:
            assert client.ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0


def test_status_command(redis_server: RedisServer) -> None:
    out = subprocess.run([*CLI, "status", "--redis-url", redis_server.url, "--prefix", "nothing-here"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sessions=0 dead_letters=0" in out.stdout


def test_bench_passes_its_options_through() -> None:
    out = subprocess.run([*CLI, "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--size" in out.stdout and "--only" in out.stdout


def test_update_weights_announces_on_the_control_stream(redis_server: RedisServer) -> None:
    url = redis_server.url
    prefix = "cliw"
    base = [*CLI, "update-weights", "--redis-url", url, "--prefix", prefix, "--model", "reference-lm",
            "--allow-unserved"]  # no worker in this cell
    out = subprocess.run([*base, "--version", "2", "--path", "/ckpt/v2", "--abort-in-flight"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "version 2" in out.stdout, out.stderr[-2000:]
    out = subprocess.run([*base, "--version", "3", "--path", "/ckpt/v3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    out = subprocess.run([*base, "--version", "4", "--path", "/ckpt/v4", "--in-flight", "continue"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    for wrong, says in ((["--in-flight", "drop"], "invalid choice: 'drop'"),
                        (["--in-flight", "continue", "--abort-in-flight"], "contradicts --in-flight continue")):
        refused = subprocess.run([*base, "--version", "5", "--path", "/x", *wrong], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr[-2000:]
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(f"{prefix}:{{0}}:control")
        fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]
    finally:
        client.close()
    assert [(f["version"], f["path"], f["in_flight"]) for f in fields] == [("2", "/ckpt/v2", "abort"),
                                                                          ("3", "/ckpt/v3", "finish"),
                                                                          ("4", "/ckpt/v4", "continue")]
    bad = subprocess.run([*base, "--version", "0", "--path", "/x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "update-weights: policy versions start at 1"
