"""The compose tier: docker-compose.yml run for real, one compose project for the whole run.

Tests here carry the ``compose`` mark and are collected only when ``-m`` names it
(tests/conftest.py); scripts/run_compose_tests.sh (``make test-compose``) starts dockerd and builds
the images first. The project has a name of its own per run, a fresh password in an env file
outside the repository, and host ports Docker picks; it is taken down with its volumes at the end,
whatever happened."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose.cell import ComposeCell

ROOT = Path(__file__).resolve().parents[2]
FLEET_IMAGE = "rollout-fleet:latest"


def _images() -> dict[str, str]:
    """The images the default profile runs: the ones `make images` built, unless the caller's
    environment names others (COMPOSE_TEST_REDIS_IMAGE, e.g. the official redis:7.0)."""
    import os

    return {"REDIS_IMAGE": os.environ.get("COMPOSE_TEST_REDIS_IMAGE", "rollout-fleet-redis:local"),
            "PROMETHEUS_IMAGE": os.environ.get("COMPOSE_TEST_PROMETHEUS_IMAGE", "rollout-fleet-prometheus:local")}


def _require_docker(images: list[str]) -> None:
    if shutil.which("docker") is None:
        pytest.fail("no docker CLI: run scripts/run_compose_tests.sh (make test-compose), which installs it")
    info = subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False)
    if info.returncode != 0:
        pytest.fail("no Docker daemon answers: scripts/docker_up.sh starts one")
    for image in images:
        found = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60, check=False)
        if found.returncode != 0:
            pytest.fail(f"image {image} is missing: `make images` builds it")


@pytest.fixture(scope="session")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeCell]:
    images = _images()
    _require_docker([FLEET_IMAGE, images["REDIS_IMAGE"], images["PROMETHEUS_IMAGE"]])
    env_file = tmp_path_factory.mktemp("compose") / "test.env"
    password = secrets.token_hex(24)
    lines = {"REDIS_PASSWORD": password, "REDIS_PORT": "0", "GATEWAY_PORT": "0", "PROMETHEUS_PORT": "0",
             "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(8), **images}
    env_file.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    env_file.chmod(0o600)
    compose = ComposeCell(ROOT, f"rfcompose{secrets.token_hex(4)}", env_file, password)
    try:
        compose.up()
        yield compose
    finally:
        compose.down()
