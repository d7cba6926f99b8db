"""docker-compose.yml run for real: the default profile up and healthy, every service answering
through its published ports, Prometheus of the monitoring profile scraping them, the demo trainer
of the trainer profile, three workers, a worker crashed (its restart policy brings it back), one
`docker kill`ed and one stopped (its SIGTERM drain) while a trainer steps without losing a step,
and `down -v` leaving nothing behind.

The tests run in this order against one project (tests/compose/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import pytest

from tests.compose.cell import UP_S, ComposeCell, finish, until

pytestmark = pytest.mark.compose

DEFAULT_SERVICES = {"redis", "worker", "supervisor", "gateway"}


def _summary(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("committed=")]
    assert lines, f"the trainer printed no summary:\n{out}"
    return lines[-1]


def _families(metrics_text: str) -> set[str]:
    """The metric names a /metrics page declares (its # HELP lines)."""
    return {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# HELP ")}


def _live_workers(cell: ComposeCell) -> list[dict[str, Any]]:
    return [w for w in cell.status()["workers"] if w["live"]]


def _container_of(cell: ComposeCell, worker_id: str) -> str:
    """The worker container whose hostname (its short id) the worker id carries: w-<hostname>-..."""
    for container in cell.containers("worker"):
        if worker_id.startswith(f"w-{container['ID'][:12]}-"):
            return str(container["Name"])
    raise AssertionError(f"no running worker container for {worker_id}")


def test_default_profile_is_up_and_healthy(cell: ComposeCell) -> None:
    running = {c["Service"]: c for c in cell.containers()}
    assert set(running) == DEFAULT_SERVICES
    for service, container in running.items():
        assert container["State"] == "running", (service, container["Status"])
        assert container["Health"] == "healthy", (service, container["Status"])
    assert len(_live_workers(cell)) == 2  # both replicas registered, seen through Redis's published port


def test_gateway_health_and_every_metrics_answer_through_published_ports(cell: ComposeCell) -> None:
    status, body = cell.http("gateway", 8000, "/health")
    assert status == 200 and '"live_workers":2' in body.replace(" ", "")
    status, body = cell.http("gateway", 8000, "/metrics")
    assert status == 200 and "rollout_fleet_steps_total" in _families(body)
    status, body = cell.http("supervisor", 9100, "/metrics")
    assert status == 200 and "rollout_fleet_sessions" in _families(body)
    for index in (1, 2):
        status, body = cell.http("worker", 9100, "/metrics", index)
        assert status == 200 and "rollout_fleet_engine_ready 1.0" in body.splitlines(), index


def test_prometheus_of_the_monitoring_profile_scrapes_every_replica(cell: ComposeCell) -> None:
    """Prometheus (the image PROMETHEUS_IMAGE names) finds both worker replicas by DNS, the
    supervisor and the gateway, and every target is up."""
    cell.compose("--profile", "monitoring", "up", "-d", "--wait", "prometheus", timeout=UP_S)

    def targets_up() -> dict[str, int] | None:
        active = cell.json_get("prometheus", 9090, "/api/v1/targets?state=active")["data"]["activeTargets"]
        up: dict[str, int] = {}
        for target in active:
            if target["health"] == "up":
                up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
        wanted = {"rollout-fleet-workers": 2, "rollout-fleet-supervisor": 1, "rollout-fleet-gateway": 1}
        return up if up == wanted else None

    until("Prometheus scrapes 2 workers, the supervisor and the gateway", targets_up, 90, interval=2.0)
    cell.compose("--profile", "monitoring", "stop", "prometheus")


def test_trainer_profile_runs_the_demo_trainer_without_a_lost_step(cell: ComposeCell) -> None:
    code, out = finish(cell.trainer())  # the service's own command: demo --workers 0 --sessions 16 --steps 40
    assert code == 0, out
    assert _summary(out).startswith("committed=640 failed=0 lost=0"), out
    assert cell.password not in out  # the Redis URL it prints is redacted


def test_scaled_to_three_workers_heals_while_a_trainer_steps(cell: ComposeCell) -> None:
    cell.up("--scale", "worker=3")
    until("3 live workers", lambda: len(_live_workers(cell)) == 3, 60)
    trainer = cell.trainer("demo", "--workers", "0", "--sessions", "30", "--steps", "60", "--no-progress")
    try:
        owners = until("every worker owns sessions", lambda: _owners(cell, 3), 120)
        crashed, killed, stopped = (_container_of(cell, w["worker_id"]) for w in owners)
        _crash(cell, crashed)  # its process dies: the restart policy starts it again
        subprocess.run(["docker", "kill", killed], check=True, capture_output=True, timeout=60)  # stays down
        until(f"{crashed} restarted and healthy", lambda: _healthy_after_restart(cell, crashed), UP_S)
        assert trainer.poll() is None, "the trainer ended before the drain could be seen: give it more steps"
        subprocess.run(["docker", "stop", "-t", "60", stopped], check=True, capture_output=True, timeout=120)
        code, out = finish(trainer)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert code == 0, out
    assert _summary(out).startswith("committed=1800 failed=0 lost=0"), out
    assert cell.inspect(killed)["State"]["Status"] == "exited"  # `docker kill` is a stop: no restart
    stopped_state = cell.inspect(stopped)["State"]
    assert stopped_state["ExitCode"] == 0  # SIGTERM drained it well within stop_grace_period
    logs = subprocess.run(["docker", "logs", stopped], capture_output=True, text=True, timeout=60, check=True)
    assert "drained" in logs.stdout + logs.stderr
    cell.up("--scale", "worker=3")  # the operator's heal for what was killed or stopped by hand
    until("3 live workers again", lambda: len(_live_workers(cell)) == 3, 60)


def _owners(cell: ComposeCell, count: int) -> list[dict[str, Any]] | None:
    """The live workers once ``count`` of them own sessions, else None."""
    owning = [w for w in _live_workers(cell) if w["load"] > 0]
    return owning if len(owning) == count else None


def _crash(cell: ComposeCell, name: str) -> None:
    """SIGKILL the container's init process from the host: a crash, not a stop through Docker's API."""
    pid = int(cell.inspect(name)["State"]["Pid"])
    assert pid > 0, name
    os.kill(pid, signal.SIGKILL)


def _healthy_after_restart(cell: ComposeCell, name: str) -> bool:
    state = cell.inspect(name)
    return int(state["RestartCount"]) >= 1 and state["State"].get("Health", {}).get("Status") == "healthy"


def test_down_leaves_nothing_running(cell: ComposeCell) -> None:
    done = cell.down()
    assert done.returncode == 0, done.stderr
    assert cell.leftovers() == {"containers": [], "volumes": [], "networks": []}
