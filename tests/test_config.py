"""The cell configuration: one owner of its defaults, the environment read only at the edge, flags
winning over the environment, bad values refused with a message naming them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from broker import FleetClient
from broker.ops.supervisor import SupervisorSettings
from broker.redis.config import ENV_VARS, CellConfig, ConfigError
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from cli.args import build_parser, resolve, setting_default
from cli.demo import DemoConfig
from cli.main import main
from workers.settings import WorkerSettings

ENV = {
    "ROLLOUT_FLEET_REDIS_URL": "redis://10.0.0.7:6380/2",
    "ROLLOUT_FLEET_PREFIX": "envp",
    "ROLLOUT_FLEET_CELL": "c7",
    "ROLLOUT_FLEET_LEASE_MS": "7000",
}


def test_from_env_without_variables_is_the_defaults() -> None:
    assert CellConfig.from_env({}) == CellConfig()
    assert CellConfig.from_env({"UNRELATED": "x"}) == CellConfig()


def test_from_env_reads_every_variable() -> None:
    config = CellConfig.from_env(ENV)
    assert config == CellConfig(redis_url="redis://10.0.0.7:6380/2", prefix="envp", cell="c7", lease_ms=7000)
    assert config.keys == CellKeys("envp", "c7")


def test_from_env_reads_os_environ_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_FLEET_PREFIX", "fromos")
    assert CellConfig.from_env().prefix == "fromos"


@pytest.mark.parametrize(("var", "value", "reason"), [
    ("ROLLOUT_FLEET_LEASE_MS", "abc", "whole number of milliseconds"),
    ("ROLLOUT_FLEET_LEASE_MS", "2.5", "whole number of milliseconds"),
    ("ROLLOUT_FLEET_LEASE_MS", "0", "positive number of milliseconds"),
    ("ROLLOUT_FLEET_LEASE_MS", "-100", "positive number of milliseconds"),
    ("ROLLOUT_FLEET_PREFIX", "a:b", "no braces, colons or spaces"),
    ("ROLLOUT_FLEET_PREFIX", "", "no braces, colons or spaces"),
    ("ROLLOUT_FLEET_CELL", "{x}", "no braces, colons or spaces"),
    ("ROLLOUT_FLEET_REDIS_URL", "http://127.0.0.1:6379", "redis://"),
])
def test_bad_environment_values_are_refused_by_name(var: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        CellConfig.from_env({var: value})
    message = str(caught.value)
    assert message.startswith(f"{var}: {value!r} refused")
    assert reason in message


@pytest.mark.parametrize("values", [{"lease_ms": 0}, {"lease_ms": True}, {"prefix": "a b"}, {"redis_url": "x"}])
def test_bad_values_are_refused_in_code_too(values: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(values))):
        CellConfig(**values)  # type: ignore[arg-type]


def test_overrides_replace_only_what_is_given() -> None:
    base = CellConfig.from_env(ENV)
    assert base.with_overrides() == base
    assert base.with_overrides(prefix="p2", lease_ms=900) == CellConfig(ENV["ROLLOUT_FLEET_REDIS_URL"], "p2", "c7", 900)


def test_the_defaults_live_in_cell_config_only() -> None:
    cell = CellConfig(prefix="px", lease_ms=8000)
    assert WorkerSettings().cell_config == CellConfig()
    assert SupervisorSettings().cell_config == CellConfig()
    assert DemoConfig().cell_config == CellConfig()
    client = FleetClient(config=cell)
    assert (client.url, client.keys, client.lease_ms) == (cell.redis_url, cell.keys, 8000)
    # the client's keyword arguments stay and win over its config
    client = FleetClient("redis://127.0.0.1:1/0", prefix="kw", cell="9", lease_ms=1234, config=cell)
    assert client.config == CellConfig("redis://127.0.0.1:1/0", "kw", "9", 1234)


def test_worker_settings_from_a_flat_mapping() -> None:
    settings = WorkerSettings.from_mapping({"redis_url": "redis://h:1/0", "prefix": "wp", "lease_ms": 900,
                                            "heartbeat_ms": 100, "capacity": None})
    assert settings.cell_config == CellConfig(redis_url="redis://h:1/0", prefix="wp", lease_ms=900)
    assert (settings.heartbeat_ms, settings.capacity) == (100, setting_default(WorkerSettings, "capacity"))
    with pytest.raises(ValueError, match="unknown worker settings: cell_config, colour"):
        WorkerSettings.from_mapping({"colour": "red", "cell_config": CellConfig()})
    with pytest.raises(ValueError, match="heartbeat_ms must be shorter than lease_ms"):
        WorkerSettings.from_mapping({"lease_ms": 500, "heartbeat_ms": 500})


def _resolve(argv: list[str], environ: dict[str, str]) -> CellConfig:
    args, _ = build_parser(environ).parse_known_args(argv)
    return resolve(args, environ).cell


def test_cli_flags_win_over_the_environment() -> None:
    assert _resolve(["worker"], ENV) == CellConfig.from_env(ENV)
    assert _resolve(["worker", "--prefix", "flagp", "--lease-ms", "900"], ENV) == CellConfig(
        redis_url=ENV["ROLLOUT_FLEET_REDIS_URL"], prefix="flagp", cell="c7", lease_ms=900)
    assert _resolve(["status", "--redis-url", "redis://127.0.0.1:1/0"], {}) == CellConfig("redis://127.0.0.1:1/0")
    # a variable the command line overrides is not read, so a bad one there does not matter
    assert _resolve(["supervisor", "--lease-ms", "800"], {"ROLLOUT_FLEET_LEASE_MS": "soon"}).lease_ms == 800


def test_cli_settings_defaults_come_from_the_dataclasses() -> None:
    args = build_parser({}).parse_args(["worker"])
    for name in ("capacity", "heartbeat_ms", "max_attempts", "drain_timeout_s"):
        assert getattr(args, name) == setting_default(WorkerSettings, name)
    assert build_parser({}).parse_args(["supervisor"]).interval_s == SupervisorSettings().interval_s
    demo = build_parser({}).parse_args(["demo"])
    assert (demo.workers, demo.sessions, demo.steps, demo.mode) == (2, 16, 40, "both") == (
        DemoConfig().workers, DemoConfig().sessions, DemoConfig().steps, DemoConfig().mode)


def test_help_says_where_a_default_comes_from(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"], environ={"ROLLOUT_FLEET_PREFIX": "helpp"})
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: helpp, from $ROLLOUT_FLEET_PREFIX)" in out
    assert f"(default: {CellConfig().redis_url}; $ROLLOUT_FLEET_REDIS_URL sets it)" in out


def test_cli_refuses_bad_values_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status"], environ={"ROLLOUT_FLEET_LEASE_MS": "soon"})
    assert exited.value.code == 2
    assert "error: ROLLOUT_FLEET_LEASE_MS: 'soon' refused" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "list", "--cell", "a:b"], environ={})
    assert "error: --cell: 'a:b' refused" in capsys.readouterr().err


def _announce_worker(url: str, keys: CellKeys, worker_id: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.zadd(keys.workers, {worker_id: int(time.time() * 1000)})
    finally:
        client.close()


def test_status_honours_the_environment_in_process(redis_server: RedisServer, prefix: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _announce_worker(redis_server.url, CellKeys(prefix, "e1"), "w-env-1")
    env = {"ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix, "ROLLOUT_FLEET_CELL": "e1"}
    assert main(["status"], environ=env) == 0
    assert "w-env-1" in capsys.readouterr().out
    assert main(["status", "--cell", "other"], environ=env) == 0  # the flag wins: another cell, empty
    assert "w-env-1" not in capsys.readouterr().out


@pytest.mark.slow
def test_status_command_reads_the_environment(redis_server: RedisServer, prefix: str) -> None:
    _announce_worker(redis_server.url, CellKeys(prefix), "w-env-2")
    env = {**os.environ, ENV_VARS["redis_url"]: redis_server.url, ENV_VARS["prefix"]: prefix}
    out = subprocess.run([sys.executable, "-m", "cli.main", "status"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "w-env-2" in out.stdout and "sessions=0 dead_letters=0" in out.stdout
