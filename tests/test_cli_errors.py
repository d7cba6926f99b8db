"""Expected mistakes answer with one line on stderr and exit 2, never a traceback; logging as the
CLI configures it (--log-format json, a quiet idle supervisor)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from broker.redis.embedded import RedisServer, free_port
from cli.main import main

CLI = [sys.executable, "-m", "cli.main"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_FLEET_")}


def _one_line_exit_2(out: subprocess.CompletedProcess[str], says: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize(("argv", "says"), [
    (["status"], "rollout-fleet status: error: Redis at redis://fleet:***@127.0.0.1:{port}/0 did not answer"),
    (["replay", "list"], "rollout-fleet replay: error: Redis at"),
    (["update-weights", "--model", "m", "--version", "2", "--path", "/w"], "update-weights: Error"),
])
def test_redis_down_is_one_line(argv: list[str], says: str) -> None:
    port = free_port()  # nothing listens there
    url = f"redis://fleet:hunter2@127.0.0.1:{port}/0"
    out = subprocess.run([*CLI, *argv], env={**ENV, "ROLLOUT_FLEET_REDIS_URL": url}, capture_output=True, text=True,
                         timeout=60)
    _one_line_exit_2(out, says.format(port=port))
    assert "hunter2" not in out.stderr


def test_a_missing_extra_names_it() -> None:
    # fastapi absent as in a plain `pip install rollout-fleet` (None in sys.modules makes its import fail)
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from cli.main import main; sys.exit(main(['gateway', '--redis-url', 'redis://127.0.0.1:1/0']))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    _one_line_exit_2(out, "rollout-fleet gateway: error: the gateway verb needs fastapi: "
                          "install rollout-fleet[gateway]")


@pytest.mark.parametrize(("argv", "says"), [
    (["--log-level", "loud", "status"], "rollout-fleet: error: argument --log-level: invalid choice: 'LOUD'"),
    (["status", "--log-level", "loud"], "rollout-fleet status: error: argument --log-level: invalid choice"),
    (["worker", "--heartbeat-ms", "5000"], "rollout-fleet worker: error: heartbeat 5000 ms"),
    (["worker", "--heartbeat-ms", "900", "--lease-ms", "600"], "shorter than the lease, 600 ms"),
    (["worker", "--rebalance-interval", "-1"], "--rebalance-interval ($ROLLOUT_FLEET_REBALANCE_INTERVAL_S) -1 must be"),
    (["worker", "--rebalance-threshold", "0"], "--rebalance-threshold ($ROLLOUT_FLEET_REBALANCE_THRESHOLD) 0 must be"),
    (["worker", "--snapshot-every", "-1"], "--snapshot-every ($ROLLOUT_FLEET_SNAPSHOT_EVERY) -1 must be"),
    (["demo", "--engine", "vllm"], "rollout-fleet demo: error: --engine vllm: the demo runs the reference and null"),
    (["status", "--lease-ms", "soon"], "rollout-fleet status: error: argument --lease-ms: invalid int value"),
    (["frobnicate"], "rollout-fleet: error: argument command: invalid choice"),
])
def test_usage_mistakes_are_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv, environ={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_heartbeat_from_the_environment_is_checked_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["worker"], environ={"ROLLOUT_FLEET_HEARTBEAT_MS": "6000"})
    assert "$ROLLOUT_FLEET_HEARTBEAT_MS" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"], environ={})
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"rollout-fleet {importlib.metadata.version('rollout-fleet')}"


def _reap_passes(client: redis.Redis) -> set[bytes]:
    # arq marks each cron run in progress under this key (kept a while): a count of passes run.
    return set(client.keys("arq:in-progress:*:reap:*"))  # the job name carries the cell's queue


def test_idle_supervisor_logs_its_start_and_stop_only_and_json_lines(redis_server: RedisServer, prefix: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = _reap_passes(client)
    proc = subprocess.Popen([*CLI, "supervisor", "--log-format", "json", "--interval", "1", "--metrics-port", "0"],
                            env={**ENV, "ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix},
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30  # bounded: three passes at one a second
        while len(_reap_passes(client) - before) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_reap_passes(client) - before) >= 3, "the supervisor ran no reaping passes"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        client.close()
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), f"a line that is not JSON on stderr:\n{err}"
    records = [json.loads(line) for line in lines]
    for record in records:
        assert set(record) >= {"ts", "level", "logger", "message"}, record
    # One INFO line when it is up (what it looks after, how often, its metrics port), one when it
    # stops, and none for its passes.
    info = [r for r in records if r["level"] in ("INFO", "DEBUG")]
    assert [r["logger"] for r in info] == ["broker.ops.supervisor"] * 2, info
    up, down = (r["message"] for r in info)
    assert up.startswith(f"supervisor of cell 0 of prefix {prefix} up: reap every 1 s, trim every 30 s, on arq; "
                         "metrics on port "), up
    assert int(up.rsplit(" ", 1)[1]) > 0, up  # --metrics-port 0: the port it was given
    assert down == f"supervisor of cell 0 of prefix {prefix} stopped"


def test_json_log_lines_carry_the_exception() -> None:
    code = ("import logging, sys, json\n"
            "from cli.logs import configure_logging\n"
            "configure_logging('INFO', 'json')\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('x.y').exception('boom %d', 7)\n")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    (line,) = out.stderr.strip().splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["message"]) == ("ERROR", "x.y", "boom 7")
    assert "ZeroDivisionError" in record["exc_info"]


@pytest.mark.parametrize("argv", [["cells"], ["status", "--cell", "*"], ["sessions", "list", "--cell", "*"]])
@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_malformed_cluster_url_is_one_line(argv: list[str], how: str) -> None:
    """A trailing ';' (as copied from a banner) in a cluster URL: one line, exit 2, no password shown,
    whether the URL comes from --redis-url or $ROLLOUT_FLEET_REDIS_URL."""
    url = "redis+cluster://fleet:hunter2@127.0.0.1:7000,127.0.0.1:7001;"
    env, flag = ({**ENV, "ROLLOUT_FLEET_REDIS_URL": url}, []) if how == "environment" else (ENV, ["--redis-url", url])
    out = subprocess.run([*CLI, *argv, *flag], env=env, capture_output=True, text=True, timeout=60)
    _one_line_exit_2(out, "bad node '127.0.0.1:7001;'")
    assert "hunter2" not in out.stderr


@pytest.mark.parametrize("by", ["flag", "variable"])
def test_redis_on_a_taken_port_fails_in_one_line_and_never_says_listening(redis_server: RedisServer,
                                                                          by: str) -> None:
    """A system Redis on 6379 answered as if it were the verb's own: the fleet then used it."""
    port = str(redis_server.port)  # another Redis listens there
    argv, env = (["--port", port], ENV) if by == "flag" else ([], {**ENV, "ROLLOUT_FLEET_REDIS_PORT": port})
    out = subprocess.run([*CLI, "redis", *argv], env=env, capture_output=True, text=True, timeout=60)
    _one_line_exit_2(out, f"rollout-fleet redis: error: port {port} is taken")
    assert "listening" not in out.stdout and out.stdout == ""
    assert redis.Redis(port=redis_server.port).ping()  # the other Redis is left alone


def test_redis_whose_server_dies_exits_non_zero() -> None:
    port = free_port()
    proc = subprocess.Popen([*CLI, "redis", "--port", str(port)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"redis listening at redis://127.0.0.1:{port}/0")
        client = redis.Redis(port=port)
        server_pid = int(client.info("server")["process_id"])
        client.close()
        os.kill(server_pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and err.strip() == "rollout-fleet redis: error: redis-server exited by itself with -9"
