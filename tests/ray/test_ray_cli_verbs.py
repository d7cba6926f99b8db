"""``rollout-fleet ray up|status|scale|down`` end to end: each verb a CLI process of its own
against the local Ray cluster, the Redis URL from ``ROLLOUT_FLEET_REDIS_URL`` only. The workers'
argv holds no option at all (their settings and the URL reach them through the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.redis.config import CellConfig
from tests.ray.conftest import HEARTBEAT, fleet_actors, fleet_groups

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300, func_only=True)]
CLI = [sys.executable, "-m", "cli.main"]


def cli(ray_cluster: Any, cell: CellConfig, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_FLEET_", "RAY_ADDRESS"))}
    env.update({"ROLLOUT_FLEET_REDIS_URL": cell.redis_url, "ROLLOUT_FLEET_PREFIX": cell.prefix,
                "ROLLOUT_FLEET_LEASE_MS": str(cell.lease_ms), **HEARTBEAT})
    verb, *rest = argv
    return subprocess.run([*CLI, "ray", verb, "--address", ray_cluster.address, "--name", "cli", *rest],
                          env=env, capture_output=True, text=True, timeout=240)


def answer(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def test_up_status_scale_down_from_the_command_line(ray_cluster: Any, cell: CellConfig) -> None:
    up = answer(cli(ray_cluster, cell, "up", "--workers", "2", "--num-gpus", "0", "--engine", "null",
                    "--engine-opt", "delay_ms=5", "--placement", "spread", "--serve-results", "0.0.0.0:0",
                    "--worker-env", "ROLLOUT_FLEET_HEARTBEAT_MS", "--json"))
    import ray

    node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    try:
        assert [(w["index"], w["live"]) for w in up["workers"]] == [(0, True), (1, True)]
        assert up["spec"]["engine"] == "null" and up["spec"]["placement"] == "spread"
        for worker in up["workers"]:  # the worker process: no option on its argv, the URL in its environment
            argv = Path(f"/proc/{worker['pid']}/cmdline").read_bytes().split(b"\0")
            assert argv[1:4] == [b"-m", b"cli.main", b"worker"] and argv[4:] in ([], [b""]), argv
            environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
            assert f"ROLLOUT_FLEET_REDIS_URL={cell.redis_url}".encode() in environ
            # large results in one hop: a free port each, advertised at the worker's node's address
            assert b"ROLLOUT_FLEET_SERVE_RESULTS=0.0.0.0:0" in environ
            assert f"ROLLOUT_FLEET_RESULTS_ADVERTISE={node_ips[worker['node_id']]}".encode() in environ
        again = cli(ray_cluster, cell, "up", "--workers", "1")
        assert again.returncode == 2 and "fleet 'cli' is already up" in again.stderr, again.stderr
        status = answer(cli(ray_cluster, cell, "status", "--json"))
        assert [w["worker_id"] for w in status["workers"]] == [w["worker_id"] for w in up["workers"]]
        text = cli(ray_cluster, cell, "status")
        assert text.returncode == 0 and "fleet cli: 2 workers (null, 0 GPU and 1 CPU each, spread); 2 live" \
            in text.stdout, text.stdout
        scaled = answer(cli(ray_cluster, cell, "scale", "--workers", "1", "--json"))
        assert [(w["index"], w["live"]) for w in scaled["workers"]] == [(0, True)]
    finally:
        down = cli(ray_cluster, cell, "down")
    assert down.returncode == 0 and "fleet cli: 1 workers drained and stopped" in down.stdout, down.stderr
    assert fleet_actors("cli") == [] and fleet_groups("cli") == []
    gone = cli(ray_cluster, cell, "status")
    assert gone.returncode == 2 and "no fleet named 'cli'" in gone.stderr, gone.stderr
