"""Every option of every verb reads ROLLOUT_FLEET_<DEST> (cli/env.py); the flag wins.

OPTIONS is the table of every option: a verb or option added without a row fails
test_every_option_is_in_the_table, and each row checks that the variable sets what the flag sets.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from broker.redis.config import ENV_VARS
from cli.args import build_parser, dashboard_settings, gateway_settings
from cli.env import env_map
from cli.main import parse_invocation

# verb -> option -> (the flag's values on the command line, the same as the variable's value).
# A flag without values is a switch; its variable takes 1/true/yes/on (0/false/no/off).
_CELL: dict[str, tuple[list[str], str]] = {
    "--redis-url": (["redis://127.0.0.1:7001/3"], "redis://127.0.0.1:7001/3"),
    "--prefix": (["pp"], "pp"), "--cell": (["c9"], "c9"), "--lease-ms": (["7000"], "7000"),
}
_NO_LEASE = {k: v for k, v in _CELL.items() if k != "--lease-ms"}
OPTIONS: dict[str, dict[str, tuple[list[str], str]]] = {
    "": {"--log-level": (["debug"], "debug"), "--log-format": (["json"], "json")},
    "worker": {**_CELL, "--engine": (["null"], "null"), "--device": (["cuda"], "cuda"),
               "--latent-shape": (["1,4,2,8,10"], "1,4,2,8,10"),
               "--engine-opt": (["a=1", "--engine-opt", "b=x y"], "a=1 'b=x y'"),
               "--worker-id": (["w-7"], "w-7"), "--capacity": (["9"], "9"), "--heartbeat-ms": (["700"], "700"),
               "--max-attempts": (["5"], "5"), "--drain-timeout": (["2.5"], "2.5"),
               "--version-wait": (["12"], "12"), "--metrics-port": (["9400"], "9400"),
               "--rebalance-interval": (["2.5"], "2.5"), "--rebalance-threshold": (["0.5"], "0.5"),
               "--durability": (["replicated"], "replicated"), "--durability-replicas": (["2"], "2"),
               "--durability-timeout": (["7.5"], "7.5"), "--snapshot-every": (["8"], "8"),
               "--closed-retention-hours": (["2.5"], "2.5"),
               "--serve-results": (["127.0.0.1:0"], "127.0.0.1:0"),
               "--results-advertise": (["10.0.0.5"], "10.0.0.5"),
               "--results-hold": (["2.5"], "2.5"), "--results-max-bytes": (["1048576"], "1048576")},
    "demo": {**_CELL, "--workers": (["3"], "3"), "--sessions": (["5"], "5"), "--steps": (["7"], "7"),
             "--mode": (["tokens"], "tokens"), "--engine": (["null"], "null"),
             "--latent-shape": (["1,4,2,8,10"], "1,4,2,8,10"), "--no-progress": ([], "yes"),
             "--kill-one": ([], "1"), "--metrics-port": (["9402"], "9402")},
    "redis": {"--port": (["7002"], "7002"), "--dir": (["/tmp/rd"], "/tmp/rd"), "--appendonly": ([], "true"),
              "--cluster": ([], "yes")},
    "status": {**_CELL, "--json": ([], "1"), "--watch": (["5"], "5"), "--check": ([], "yes"),
               "--window": (["60"], "60")},
    "sessions": {**_NO_LEASE, "--model": (["lm"], "lm"), "--owner": (["w-1"], "w-1"),
                 "--state": (["closed"], "closed"), "--limit": (["10"], "10"), "--json": ([], "1")},
    "supervisor": {**_CELL, "--interval": (["3"], "3"), "--metrics-port": (["9401"], "9401")},
    "gateway": {**_CELL, "--host": (["0.0.0.0"], "0.0.0.0"), "--port": (["8081"], "8081"),
                "--api-key": (["k1", "--api-key", "k2"], "k1,k2"), "--max-sessions-per-key": (["4"], "4"),
                "--step-timeout": (["9.5"], "9.5"), "--max-body-bytes": (["1024"], "1024"),
                "--model": (["null-world"], "null-world"), "--upstream-errors": ([], "1")},
    "dashboard": {**_CELL, "--host": (["0.0.0.0"], "0.0.0.0"), "--port": (["8082"], "8082"),
                  "--api-key": (["k1", "--api-key", "k2"], "k1,k2")},
    "update-weights": {**_NO_LEASE, "--model": (["lm"], "lm"), "--version": (["4"], "4"),
                       "--path": (["/w/4"], "/w/4"), "--wait": (["1.5"], "1.5"), "--abort-in-flight": ([], "on"),
                       "--in-flight": (["continue"], "continue"),
                       "--allow-unserved": ([], "on"), "--lease-ms": (["7000"], "7000")},
    "replay": {**_NO_LEASE, "--session": (["s1"], "s1"), "--code": (["timeout"], "timeout"),
               "--older-than": (["60"], "60"), "--newer-than": (["5"], "5"), "--limit": (["10"], "10"),
               "--dry-run": ([], "1"), "--json": ([], "1")},
    "cells": {**{k: v for k, v in _CELL.items() if k != "--cell"}, "--count": (["3"], "3"),
              "--stem": (["gpu"], "gpu"), "--json": ([], "1")},
    "trainers": {**_NO_LEASE, "--json": ([], "1")},
    "ray": {**_CELL, "--address": (["10.0.0.1:6379"], "10.0.0.1:6379"), "--name": (["f2"], "f2"),
            "--workers": (["3"], "3"), "--num-gpus": (["1"], "1"), "--num-cpus": (["2"], "2"),
            "--engine": (["null"], "null"), "--engine-opt": (["a=1", "--engine-opt", "b=x y"], "a=1 'b=x y'"),
            "--placement": (["spread"], "spread"), "--drain-timeout": (["2.5"], "2.5"),
            "--serve-results": (["0.0.0.0:0"], "0.0.0.0:0"),
            "--worker-env": (["HF_TOKEN", "--worker-env", "X"], "HF_TOKEN X"), "--wait": (["5"], "5"),
            "--min-workers": (["1"], "1"), "--max-workers": (["4"], "4"), "--target-fill": (["0.5"], "0.5"),
            "--json": ([], "1")},
    "bench": {},  # its options are bench.run_all's, passed through (and read there: the last test)
}
# What a verb needs besides the option under test: positionals, and required options (from their
# variables, so that the row's flag or variable replaces them).
BASE_ARGV = {"replay": ["list"], "sessions": ["list"], "trainers": ["list"], "ray": ["status"]}
BASE_ENV = {"update-weights": {"ROLLOUT_FLEET_MODEL": "m", "ROLLOUT_FLEET_VERSION": "1", "ROLLOUT_FLEET_PATH": "/p"}}


def _argv(verb: str, *extra: str) -> list[str]:
    if verb == "":
        return [*extra, "status"]
    return [verb, *BASE_ARGV.get(verb, []), *extra]


def _value(verb: str, flag: str, argv: list[str], environ: dict[str, str]) -> Any:
    run = parse_invocation(argv, environ)
    action = next(a for a in _actions(verb) if flag in a.option_strings)
    if action.dest in ENV_VARS:
        return getattr(run.cell, action.dest)
    if action.dest == "api_keys":
        settings = dashboard_settings if verb == "dashboard" else gateway_settings
        return settings(run.args).api_keys
    return getattr(run.args, action.dest)


def _actions(verb: str) -> list[argparse.Action]:
    parser = build_parser({})
    if verb == "":
        return parser._actions
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]._actions


def test_every_option_is_in_the_table() -> None:
    table = env_map(build_parser({}))
    assert {verb: set(flags) for verb, flags in table.items()} == {v: set(f) for v, f in OPTIONS.items()}


ROWS = [(verb, flag, values, raw) for verb, flags in OPTIONS.items() for flag, (values, raw) in flags.items()]


@pytest.mark.parametrize(("verb", "flag", "values", "raw"), ROWS, ids=[f"{r[0] or 'global'}{r[1]}" for r in ROWS])
def test_the_variable_sets_what_the_flag_sets(verb: str, flag: str, values: list[str], raw: str) -> None:
    var = env_map(build_parser({}))[verb][flag]
    base = BASE_ENV.get(verb, {})
    from_flag = _value(verb, flag, _argv(verb, flag, *values), base)
    from_env = _value(verb, flag, _argv(verb), {**base, var: raw})
    default = _value(verb, flag, _argv(verb), base)
    assert from_env == from_flag
    assert from_env != default  # the row chose a value that shows the variable was read


@pytest.mark.parametrize(("verb", "argv", "environ", "dest", "expected"), [
    ("worker", ["--capacity", "3"], {"ROLLOUT_FLEET_CAPACITY": "9"}, "capacity", 3),
    ("worker", ["--engine-opt", "a=2"], {"ROLLOUT_FLEET_ENGINE_OPT": "a=1 b=2"}, "engine_opt", ["a=2"]),
    ("replay", ["--json"], {"ROLLOUT_FLEET_JSON": "false"}, "json", True),
    ("update-weights", ["--model", "flag-model"], {"ROLLOUT_FLEET_MODEL": "env-model"}, "model", "flag-model"),
    ("status", ["--log-level", "error"], {"ROLLOUT_FLEET_LOG_LEVEL": "debug"}, "log_level", "ERROR"),
])
def test_the_flag_wins(verb: str, argv: list[str], environ: dict[str, str], dest: str, expected: Any) -> None:
    run = parse_invocation(_argv(verb, *argv), {**BASE_ENV.get(verb, {}), **environ})
    assert getattr(run.args, dest) == expected


def test_switch_variable_off_and_required_options_from_the_environment() -> None:
    assert parse_invocation(["replay", "list"], {"ROLLOUT_FLEET_DRY_RUN": "off"}).args.dry_run is False
    env = {"ROLLOUT_FLEET_MODEL": "lm", "ROLLOUT_FLEET_VERSION": "4", "ROLLOUT_FLEET_PATH": "/w"}
    args = parse_invocation(["update-weights"], env).args
    assert (args.model, args.version, args.path) == ("lm", 4, "/w")


def test_log_level_before_and_after_the_verb() -> None:
    assert parse_invocation(["--log-level", "warning", "status"], {}).args.log_level == "WARNING"
    assert parse_invocation(["status", "--log-level", "debug"], {}).args.log_level == "DEBUG"
    assert parse_invocation(["--log-level", "error", "status", "--log-format", "json"], {}).args.log_format == "json"
    assert parse_invocation(["status"], {}).args.log_level == "INFO"


def test_help_names_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser({})
    table = env_map(parser)
    for verb, flags in table.items():
        if verb == "bench":
            continue
        with pytest.raises(SystemExit):
            parse_invocation([verb, "--help"] if verb else ["--help"], {})
        out = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
        missing = [var for var in flags.values() if f"${var}" not in out]
        assert not missing, (verb, missing)


def test_secrets_from_the_environment_are_not_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ROLLOUT_FLEET_REDIS_URL": "redis://fleet:hunter2@redis:6379/0", "ROLLOUT_FLEET_API_KEY": "k-secret"}
    with pytest.raises(SystemExit):
        parse_invocation(["gateway", "--help"], env)
    out = capsys.readouterr().out
    assert "hunter2" not in out and "k-secret" not in out
    assert "redis://fleet:***@redis:6379/0" in " ".join(out.split())


@pytest.mark.parametrize(("argv", "environ", "says"), [
    (["worker"], {"ROLLOUT_FLEET_CAPACITY": "many"}, "ROLLOUT_FLEET_CAPACITY: 'many' refused"),
    (["demo"], {"ROLLOUT_FLEET_MODE": "dance"}, "ROLLOUT_FLEET_MODE: 'dance' is not one of"),
    (["replay", "list"], {"ROLLOUT_FLEET_JSON": "perhaps"}, "ROLLOUT_FLEET_JSON: expected one of"),
    (["gateway"], {"ROLLOUT_FLEET_STEP_TIMEOUT_S": "-1"}, "ROLLOUT_FLEET_STEP_TIMEOUT_S: '-1' refused"),
    (["status"], {"ROLLOUT_FLEET_LOG_LEVEL": "LOUD"}, "ROLLOUT_FLEET_LOG_LEVEL: 'LOUD' is not one of"),
])
def test_a_bad_variable_is_one_line_naming_it(argv: list[str], environ: dict[str, str], says: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_invocation(argv, environ)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_variable_of_another_verb_does_not_stop_this_one() -> None:
    assert parse_invocation(["status"], {"ROLLOUT_FLEET_CAPACITY": "many"}).args.command == "status"


def test_the_bench_verbs_options_read_the_environment_too(capsys: pytest.CaptureFixture[str]) -> None:
    """`rollout-fleet bench` passes its options to bench.run_all, which reads the same variables."""
    from bench import run_all

    env = {"ROLLOUT_FLEET_SIZE": "full", "ROLLOUT_FLEET_ONLY": "round_trip memory", "ROLLOUT_FLEET_NO_PROGRESS": "1",
           "ROLLOUT_FLEET_RESULTS": "/tmp/r.json"}
    args = run_all.parse_args([], env)
    assert (args.size, args.only, args.no_progress, str(args.results)) == ("full", ["round_trip", "memory"], True,
                                                                           "/tmp/r.json")
    assert run_all.parse_args(["--size", "smoke", "--only", "memory"], env).only == ["memory"]  # the flag wins
    assert run_all.parse_args([], {}).size == "smoke"
    with pytest.raises(SystemExit) as exited:
        run_all.parse_args([], {"ROLLOUT_FLEET_SIZE": "huge"})
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "ROLLOUT_FLEET_SIZE: 'huge' is not one of" in err


def test_each_verbs_port_has_a_variable_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """$ROLLOUT_FLEET_PORT, exported for the gateway, no longer moves a Redis or a dashboard started
    beside it: those read $ROLLOUT_FLEET_REDIS_PORT and $ROLLOUT_FLEET_DASHBOARD_PORT."""
    table = env_map(build_parser({}))
    assert (table["gateway"]["--port"], table["redis"]["--port"], table["dashboard"]["--port"]) == (
        "ROLLOUT_FLEET_PORT", "ROLLOUT_FLEET_REDIS_PORT", "ROLLOUT_FLEET_DASHBOARD_PORT")
    shared = {"ROLLOUT_FLEET_PORT": "8001"}
    assert parse_invocation(["gateway"], shared).args.port == 8001
    assert parse_invocation(["redis"], shared).args.port == 6379
    assert parse_invocation(["dashboard"], shared).args.port == 8080
    own = {**shared, "ROLLOUT_FLEET_REDIS_PORT": "7003", "ROLLOUT_FLEET_DASHBOARD_PORT": "8083"}
    assert (parse_invocation(["redis"], own).args.port, parse_invocation(["dashboard"], own).args.port) == (7003, 8083)
    for verb, var in (("redis", "ROLLOUT_FLEET_REDIS_PORT"), ("dashboard", "ROLLOUT_FLEET_DASHBOARD_PORT")):
        with pytest.raises(SystemExit):
            parse_invocation([verb, "--help"], {})
        assert f"${var}" in "".join(capsys.readouterr().out.split())  # --help names the variable


def test_the_parse_records_which_options_the_environment_set() -> None:
    env = {"ROLLOUT_FLEET_MODEL": "lm", "ROLLOUT_FLEET_LIMIT": "5", "ROLLOUT_FLEET_LOG_LEVEL": "debug"}
    assert parse_invocation(["sessions", "list", "--limit", "9"], env).args.from_env == {
        "model": "ROLLOUT_FLEET_MODEL", "log_level": "ROLLOUT_FLEET_LOG_LEVEL"}  # the flag's --limit is not
