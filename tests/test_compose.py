"""docker-compose.yml parses and has the shape the README promises (no engine runs here)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert set(services) >= {"redis", "worker", "trainer"}
    redis_cmd = services["redis"]["command"]
    assert "--appendonly" in redis_cmd and redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--appendfsync") + 1] == "always"
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # scalable
    assert worker["command"][0] == "worker" and "--redis-url" in worker["command"]
    assert services["trainer"]["command"][0] == "demo"
    assert "redis" in worker["depends_on"]


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rollout-fleet"]' in text and "torch==2.13.0" in text


def test_compose_has_a_service_per_real_engine_behind_profiles() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    engines = {name: svc["command"][svc["command"].index("--engine") + 1]
               for name, svc in services.items() if "--engine" in svc.get("command", [])}
    assert set(engines.values()) >= {"reference", "vllm", "vllm-http", "vllm-omni"}
    for name, engine in engines.items():
        assert ("profiles" in services[name]) == (engine != "reference"), name  # only the reference starts by default
    assert services["vllm-server"]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"  # weight updates
