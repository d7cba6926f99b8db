"""The arguments of ``rollout-fleet``: one small builder per verb, and the cell configuration the
flags resolve to.

No default is written here twice: the cell flags (``--redis-url``, ``--prefix``, ``--cell``,
``--lease-ms``) default to the ``ROLLOUT_FLEET_*`` environment variables, else to
:class:`CellConfig`'s defaults; every other setting's default is read from its dataclass
(:class:`WorkerSettings`, :class:`SupervisorSettings`, :class:`DemoConfig`). A flag given on the
command line wins over the environment, and ``--help`` says where each default comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from broker.gateway.settings import API_KEY_ENV, DEFAULT_MODEL, GatewaySettings, parse_api_keys
from broker.ops.metrics import metrics_port
from broker.ops.sessions import STATES as SESSION_STATES
from broker.ops.status import DEFAULT_CHECK_WINDOW_S
from broker.ops.supervisor import SupervisorSettings
from broker.ops.weights import IN_FLIGHT
from broker.redis.config import ENV_VARS, CellConfig, ConfigError
from broker.redis.durability import DURABILITY_MODES
from cli.demo import DemoConfig
from cli.env import attach_env, name_variable
from cli.errors import redact
from cli.logs import FORMATS, LEVELS
from schemas.results_wire import parse_address, parse_host_or_address
from workers.engines.registry import ENGINE_HELP, engine_name
from workers.ray_fleet.autoscale import Autoscale
from workers.settings import WorkerSettings

DESCRIPTION = "rollout-fleet: worker, demo, redis (embedded, foreground) and status commands."
# The worker's own settings the CLI sets (flag dests are these field names).
WORKER_SETTINGS = ("worker_id", "capacity", "heartbeat_ms", "max_attempts", "drain_timeout_s", "version_wait_s",
                   "metrics_port", "rebalance_interval_s", "rebalance_threshold",
                   "durability", "durability_replicas", "durability_timeout_s", "snapshot_every",
                   "closed_retention_hours", "serve_results", "results_advertise", "results_hold_s",
                   "results_max_bytes")
_CELL_HELP = {"redis_url": "Redis URL", "prefix": "key prefix", "cell": "cell hash tag; '*': every cell",
              "lease_ms": "lease in ms: a worker silent this long is failed over (one value per cell)"}


@dataclass(frozen=True)
class Invocation:
    """What a verb runs with: its parsed flags and the cell configuration they resolve to."""

    args: argparse.Namespace
    cell: CellConfig
    redis_url_given: bool  # by flag or environment; the demo starts its own Redis otherwise


def setting_default(cls: type[Any], name: str) -> Any:
    """The default of one field of a settings dataclass."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def _cell_default_text(name: str, environ: Mapping[str, str], fallback: str | None) -> str:
    var = ENV_VARS[name]
    if var in environ:  # a URL's password is not shown
        return f"default: {redact(environ[var])}, from ${var}"
    value = fallback if fallback is not None else setting_default(CellConfig, name)
    return f"default: {value}; ${var} sets it"


def add_cell_flags(p: argparse.ArgumentParser, environ: Mapping[str, str], *, lease: bool,
                   url_fallback: str | None = None, cell: bool = True) -> None:
    """--redis-url, --prefix, --cell (and --lease-ms): None on the command line means the
    environment's value, else CellConfig's (resolved by :func:`resolve`)."""
    names = ["redis_url", "prefix", *(["cell"] if cell else []), *(["lease_ms"] if lease else [])]
    for name in names:
        fallback = url_fallback if name == "redis_url" else None
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int if name == "lease_ms" else str,
                       default=None, help=f"{_CELL_HELP[name]} ({_cell_default_text(name, environ, fallback)})")


def _setting(p: argparse.ArgumentParser, flag: str, cls: type[Any], name: str, text: str, **kw: Any) -> None:
    """A flag whose default is the settings dataclass's own."""
    kw.setdefault("type", type(setting_default(cls, name)))
    kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    p.add_argument(flag, dest=name, default=setting_default(cls, name), help=f"{text} (default: %(default)s)", **kw)


def _port(text: str) -> int:
    try:
        return metrics_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _checked_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An option's type: its text as given, once ``parse`` accepts it (its ValueError: one line)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    check.__name__ = parse.__name__  # what argparse names in "invalid ... value"
    return check


_address = _checked_by(parse_address)  # --serve-results HOST:PORT
_host_or_address = _checked_by(parse_host_or_address)  # --results-advertise HOST[:PORT]


def add_metrics_port(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """--metrics-port: off unless given (its $ROLLOUT_FLEET_METRICS_PORT comes from cli.env,
    like every option's variable, and is checked by the same ``_port``)."""
    p.add_argument("--metrics-port", dest="metrics_port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (default: off)")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latent-shape", default=None, help="reference world latent shape, e.g. 1,16,2,44,80")
    p.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (value parsed as JSON when it can be), repeatable")


WORKER_SIGNALS = ("SIGTERM or SIGINT drains the worker: it takes no new sessions, finishes its in-flight steps "
                  "and hands its sessions to live workers (up to --drain-timeout). A second SIGTERM or SIGINT "
                  "stops it at once: its sessions move by failover once its lease expires, their queued and "
                  "unacknowledged jobs with them; nothing committed is lost.")


def _worker(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    p.epilog = WORKER_SIGNALS
    add_cell_flags(p, environ, lease=True)
    p.add_argument("--engine", type=engine_name, default="reference", help=ENGINE_HELP)
    p.add_argument("--device", default=None, help="reference engines: cpu (default) or cuda")
    _engine_flags(p)
    p.add_argument("--worker-id", dest="worker_id", default=None, help="(default: a fresh id per start)")
    _setting(p, "--capacity", WorkerSettings, "capacity", "sessions this worker may own, over all its models")
    _setting(p, "--heartbeat-ms", WorkerSettings, "heartbeat_ms", "heartbeat interval")
    _setting(p, "--max-attempts", WorkerSettings, "max_attempts", "engine attempts per step (transient errors)")
    _setting(p, "--drain-timeout", WorkerSettings, "drain_timeout_s",
             "seconds to finish in-flight jobs and, when no live worker has room, to keep serving sessions "
             "(after the first SIGTERM/SIGINT; a second one stops the worker at once: its sessions move "
             "by failover after its lease)")
    _setting(p, "--rebalance-interval", WorkerSettings, "rebalance_interval_s",
             "seconds between checks that move sessions to less loaded workers; 0: off")
    _setting(p, "--rebalance-threshold", WorkerSettings, "rebalance_threshold",
             "session share (sessions/capacity) by which this worker must exceed a target to move sessions")
    _setting(p, "--version-wait", WorkerSettings, "version_wait_s",
             "seconds a step waits for its min_policy_version before it fails with timeout")
    _setting(p, "--durability", WorkerSettings, "durability", "async: a step's reply goes out with its commit; "
             "replicated: only once a replica has the commit (Redis WAIT)", choices=DURABILITY_MODES)
    _setting(p, "--durability-replicas", WorkerSettings, "durability_replicas",
             "replicated: replicas that must have a commit before its reply goes out")
    _setting(p, "--durability-timeout", WorkerSettings, "durability_timeout_s",
             "replicated: seconds a step waits for its replicas before it answers timeout")
    _setting(p, "--closed-retention-hours", WorkerSettings, "closed_retention_hours",
             "hours a closed session still answers status and close (closed: true)", type=_positive(float))
    _setting(p, "--snapshot-every", WorkerSettings, "snapshot_every",
             "snapshot a session's engine context every N committed steps (engines that can export "
             "it), so failover replays at most N steps; 0: off")
    p.add_argument("--serve-results", dest="serve_results", type=_address, default=None, metavar="HOST:PORT",
                   help="hand large committed results to their trainers from here, one hop instead of two "
                        "through Redis (port 0: a free one; default: off; durability async only)")
    p.add_argument("--results-advertise", dest="results_advertise", type=_host_or_address, default=None,
                   metavar="HOST[:PORT]", help="the address trainers reach --serve-results at; a HOST alone gets "
                                               "the port it listens on (default: the address it listens on; "
                                               "needed when that is 0.0.0.0 or ::)")
    _setting(p, "--results-hold", WorkerSettings, "results_hold_s",
             "seconds a large result waits for its trainer to fetch it before only Redis has it",
             type=_positive(float))
    _setting(p, "--results-max-bytes", WorkerSettings, "results_max_bytes",
             "bytes of large results held for trainers at most (the oldest go first)", type=_positive(int))
    add_metrics_port(p, environ)


def _demo(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True, url_fallback="an embedded Redis for the run")
    _setting(p, "--workers", DemoConfig, "workers", "worker processes to start")
    _setting(p, "--sessions", DemoConfig, "sessions", "sessions to create")
    _setting(p, "--steps", DemoConfig, "steps", "steps per session")
    _setting(p, "--mode", DemoConfig, "mode", "session modes", choices=("world_model_env", "tokens", "both"))
    _setting(p, "--engine", DemoConfig, "engine", f"engine of the workers: {ENGINE_HELP}", type=engine_name)
    p.add_argument("--latent-shape", default=None, help="world latent shape (default 1,16,2,44,80)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--kill-one", action="store_true",
                   help="SIGKILL one worker a third of the way through: its sessions move, nothing is lost")
    p.add_argument("--metrics-port", dest="metrics_port", type=_port, default=None, metavar="PORT",
                   help="worker i serves Prometheus metrics on PORT+i (default: off)")


def _redis(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    # Its own variable: $ROLLOUT_FLEET_PORT is the gateway's (cli.env).
    name_variable(p.add_argument("--port", type=int, default=6379,
                                 help="port to listen on (default: %(default)s); taken, the verb fails"), "redis_port")
    p.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    p.add_argument("--appendonly", action="store_true", help="AOF with appendfsync always")
    p.add_argument("--cluster", action="store_true",
                   help="a local Redis Cluster (3 masters, 1 replica each, on free ports) instead of one node; "
                        "prints its redis+cluster:// URL (--port, --dir and --appendonly do not apply)")


def _status(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True)
    p.add_argument("--json", action="store_true", help="the whole report as one JSON object")
    p.add_argument("--watch", nargs="?", type=_positive(float), const=2.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--check", action="store_true",
                   help="one line; exit 1 when no worker is live, a live worker's engine is not ready, "
                        "or a dead letter arrived within --window")
    p.add_argument("--window", type=_positive(float), default=DEFAULT_CHECK_WINDOW_S, metavar="SECONDS",
                   help="--check: dead letters newer than this fail the check (default: %(default)s)")


def _supervisor(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True)
    _setting(p, "--interval", SupervisorSettings, "interval_s", "seconds between reaping passes")
    add_metrics_port(p, environ)


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _listen_and_keys(p: argparse.ArgumentParser, environ: Mapping[str, str], *, port: int, what: str,
                     key_use: str, port_variable: str | None = None) -> None:
    """The flags an HTTP verb shares (gateway, dashboard): the cell, where it listens, its API keys.
    ``port_variable``: the variable of --port when it is not $ROLLOUT_FLEET_PORT (the gateway's)."""
    add_cell_flags(p, environ, lease=True)
    p.add_argument("--host", default="127.0.0.1")
    listen = p.add_argument("--port", type=int, default=port, help="port to listen on (default: %(default)s)")
    if port_variable is not None:
        name_variable(listen, port_variable)
    # The keys' values never appear in --help (unlike the cell flags' defaults).
    source = f"default: the keys in ${API_KEY_ENV}" if environ.get(API_KEY_ENV) else f"${API_KEY_ENV} sets it"
    p.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                   help=f"API key {key_use}; repeatable, or comma-separated ({source}; without keys {what} is open)")
    p.set_defaults(api_keys_env=environ.get(API_KEY_ENV, ""))


def _gateway(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _listen_and_keys(p, environ, port=8000, what="the gateway",
                     key_use="a client must send as 'Authorization: Bearer KEY'")
    # --default-model is the earlier spelling, kept as an alias; the last string names the variable.
    p.add_argument("--default-model", "--model", dest="model", default=DEFAULT_MODEL, metavar="MODEL",
                   help="the served model: 'dreamzero' on create names it when it is a DreamZero model; "
                        "GET /health is 200 only while a live worker serves it (default: %(default)s)")
    _setting(p, "--max-sessions-per-key", GatewaySettings, "max_sessions_per_key",
             "open sessions one API key may hold", type=_positive(int))
    _setting(p, "--step-timeout", GatewaySettings, "step_timeout_s",
             "seconds an HTTP client waits for a step's result (then 504)", type=_positive(float))
    _setting(p, "--max-body-bytes", GatewaySettings, "max_body_bytes",
             "largest request body read (then 413)", type=_positive(int))
    p.add_argument("--upstream-errors", action="store_true",
                   help="answer a re-sent committed step as vLLM-Omni does (400 step_already_committed) "
                        "instead of with its stored result and X-Rollout-Duplicate: true")


def _dashboard(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _listen_and_keys(p, environ, port=8080, what="the page", port_variable="dashboard_port",
                     key_use="the page needs ('Authorization: Bearer KEY', or ?key=KEY once in a browser)")


def dashboard_settings(args: argparse.Namespace) -> GatewaySettings:
    """The dashboard verb's keys (flags, else the environment), in the gateway's settings type."""
    return GatewaySettings(api_keys=parse_api_keys(args.api_keys if args.api_keys else [args.api_keys_env]))


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    """The gateway verb's settings: keys from the flags, else from the environment."""
    keys = parse_api_keys(args.api_keys if args.api_keys else [args.api_keys_env])
    return GatewaySettings(api_keys=keys, max_sessions_per_key=args.max_sessions_per_key,
                           step_timeout_s=args.step_timeout_s, max_body_bytes=args.max_body_bytes,
                           upstream_errors=args.upstream_errors)


def _update_weights(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True)  # the lease tells the live workers (the model must be served)
    p.add_argument("--model", required=True)
    p.add_argument("--version", type=int, required=True, help="policy version (>= 1, increasing)")
    p.add_argument("--path", required=True, help="weights path as the workers see it")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait until every worker reports it")
    p.add_argument("--in-flight", choices=IN_FLIGHT, default=None,
                   help="running steps: finish them on the old weights (default), abort them (they run again on "
                        "the new weights), or continue (token steps keep their generated tokens and go on from "
                        "them on the new weights)")
    p.add_argument("--abort-in-flight", action="store_true", help="the same as --in-flight abort")
    p.add_argument("--allow-unserved", action="store_true",
                   help="announce even when no live worker serves --model (workers that start later load it)")


def _sessions(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=False)
    p.add_argument("action", choices=("list", "show", "close"))
    p.add_argument("session_id", nargs="?", default=None, metavar="SESSION_ID", help="show/close: the session")
    p.add_argument("--model", default=None, help="list: only this model's sessions")
    p.add_argument("--owner", default=None, help="list: only sessions this worker owns")
    p.add_argument("--state", default=None, choices=SESSION_STATES, help="list: only sessions in this state")
    p.add_argument("--limit", type=_positive(int), default=1000, help="list: at most this many (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="JSON (list: one object per line)")


def _replay(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=False)
    p.add_argument("action", choices=("list", "show", "run"))
    p.add_argument("ids", nargs="*", help="dead-letter entry ids (show/run)")
    p.add_argument("--session", default=None)
    p.add_argument("--code", default=None, help="error code, e.g. inference_error")
    p.add_argument("--older-than", type=float, default=None, help="seconds")
    p.add_argument("--newer-than", type=float, default=None, help="seconds")
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON lines")


def _cells(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True, cell=False)  # the lease tells live cells; a cell is the output
    p.add_argument("action", nargs="?", choices=["list", "suggest"], default="list",
                   help="list: the cells of the registry; suggest: cell names on distinct masters")
    p.add_argument("--count", type=_positive(int), default=2, help="suggest: how many cells (default 2)")
    p.add_argument("--stem", default="c", help="suggest: names are STEM + a number (default c)")
    p.add_argument("--json", action="store_true", help="one JSON object")


def _trainers(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=False)
    p.add_argument("action", choices=("list", "set-cap", "remove-cap", "set-default-cap", "remove-default-cap"),
                   help="set-cap NAME CAP, remove-cap NAME; the default cap binds every trainer without its own: "
                        "set-default-cap CAP, remove-default-cap")
    p.add_argument("values", nargs="*", metavar="NAME|CAP", help="the trainer and/or the cap, as the action says")
    p.add_argument("--json", action="store_true", help="list: one JSON object per line")


def _ray(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_cell_flags(p, environ, lease=True)
    p.add_argument("action", choices=("up", "status", "scale", "down"))
    name_variable(p.add_argument("--address", default=None, help="the Ray cluster's address (default: auto: "
                                 "the cluster this node belongs to, or $RAY_ADDRESS)"), "ray_address")
    name_variable(p.add_argument("--name", default="rollout-fleet", help="the fleet's name on the Ray cluster "
                                 "(default: %(default)s)"), "ray_name")
    name_variable(p.add_argument("--workers", type=_at_least_zero, default=None, metavar="N",
                                 help="up, scale: worker actors, one worker process each"), "ray_workers")
    p.add_argument("--num-gpus", type=_at_least_zero_float, default=0.0, metavar="G",
                   help="up: GPUs per worker, reserved by a placement group (default: 0, CPU only)")
    p.add_argument("--num-cpus", type=_at_least_zero_float, default=1.0, metavar="C",
                   help="up: CPUs per worker (default: %(default)s)")
    p.add_argument("--engine", type=engine_name, default="reference", help=f"up: {ENGINE_HELP}")
    p.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="up: engine option of every worker (value parsed as JSON when it can be), repeatable")
    p.add_argument("--placement", choices=("pack", "spread"), default="pack",
                   help="up: the workers of one up or scale on as few nodes as fit, or spread (default: %(default)s)")
    _setting(p, "--drain-timeout", WorkerSettings, "drain_timeout_s", "up: each worker's drain bound")
    p.add_argument("--serve-results", dest="serve_results", type=_address, default=None, metavar="HOST:PORT",
                   help="up: every worker hands large results to its trainers itself, one hop instead of two "
                        "(0.0.0.0:0: a free port each, advertised at its node's address; default: off)")
    p.add_argument("--worker-env", action="append", default=[], metavar="NAME",
                   help="up: a variable of this environment the workers get too (a token, ROLLOUT_FLEET_CAPACITY); "
                        "repeatable")
    p.add_argument("--min-workers", type=_at_least_zero, default=None, metavar="N",
                   help="up: autoscale between --min-workers and --max-workers on the sessions the workers own")
    p.add_argument("--max-workers", type=_at_least_zero, default=None, metavar="N", help="up: see --min-workers")
    _setting(p, "--target-fill", Autoscale, "target_fill",
             "up, autoscaling: the sessions / capacity of the workers to aim at", type=_positive(float))
    name_variable(p.add_argument("--wait", type=_at_least_zero_float, default=300.0, metavar="SECONDS",
                                 help="up, scale: wait this long for the workers to be live in the cell "
                                      "(default: %(default)s)"), "ray_wait")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(environ=environ)  # --worker-env's values, read from the same mapping as every default


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _at_least_zero_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


_Builder = Callable[[argparse.ArgumentParser, Mapping[str, str]], None]
# verb -> (help, builder of its arguments)
VERBS: dict[str, tuple[str, _Builder]] = {
    "worker": ("run a worker process", _worker),
    "demo": ("a local fleet: embedded Redis, worker processes and a trainer loop", _demo),
    "redis": ("run the embedded Redis server in the foreground", _redis),
    "status": ("workers and sessions of a cell (--cell '*': of every cell), from Redis alone", _status),
    "supervisor": ("arq supervisor: lease reaper/failover, trimming, replay jobs", _supervisor),
    "gateway": ("vLLM-Omni-compatible HTTP rollout API in front of the fleet", _gateway),
    "update-weights": ("tell the workers of a model to load new weights", _update_weights),
    "replay": ("list, show and re-enqueue dead-lettered jobs", _replay),
    "dashboard": ("the live web dashboard alone, without a gateway", _dashboard),
    "sessions": ("list, show and close the sessions of a cell (--cell '*': of every cell)", _sessions),
    "cells": ("the deployment's cells and their slots; suggest cell names on distinct masters", _cells),
    "trainers": ("caps on each trainer's open sessions per cell (--cell '*': every cell)", _trainers),
    "ray": ("the fleet's workers on a Ray cluster: up, status, scale, down", _ray),
}


class Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line on stderr and exit 2 (not the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    try:
        return importlib.metadata.version("rollout-fleet")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def _log_flags(p: argparse.ArgumentParser, *, after_verb: bool) -> None:
    """--log-level and --log-format: before the verb (with the defaults) and after it (SUPPRESS:
    only a value given there replaces the global one)."""
    p.add_argument("--log-level", type=str.upper, choices=LEVELS,
                   default=argparse.SUPPRESS if after_verb else "INFO", help="log level (default: INFO)")
    p.add_argument("--log-format", choices=FORMATS, default=argparse.SUPPRESS if after_verb else "text",
                   help="text (default), or json: one JSON object a line (ts, level, logger, message, exc_info)")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser; ``environ`` supplies the defaults of every option (:mod:`cli.env`)."""
    parser = Parser(prog="rollout-fleet", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"rollout-fleet {package_version()}")
    _log_flags(parser, after_verb=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for verb, (text, build) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=text)
        build(verb_parser, environ)
        _log_flags(verb_parser, after_verb=True)
    # Its options are bench.run_all's own (--size, --only, --plot, ...): passed through untouched.
    sub.add_parser("bench", help="benchmarks beside their anchors (arq, streaq, HTTP); prints a table "
                                 "(--size smoke: about 6 minutes on 2 cores)",
                   add_help=False)
    attach_env(parser, environ)
    for verb_parser in sub.choices.values():
        attach_env(verb_parser, environ)
    return parser


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> Invocation:
    """The cell configuration of this invocation: defaults, then the environment, then the flags
    given. A variable the command line overrides is not read (a bad one there cannot stop a run
    that does not use it). Raises ConfigError naming the bad flag or variable."""
    given = {name: getattr(args, name) for name in ENV_VARS if getattr(args, name, None) is not None}
    if not any(hasattr(args, name) for name in ENV_VARS):  # a verb without cell flags (redis, bench)
        return Invocation(args, CellConfig(), redis_url_given=False)
    unread = {ENV_VARS[name] for name in given}
    env = {var: value for var, value in environ.items() if var in ENV_VARS.values() and var not in unread}
    base = CellConfig.from_env(env)
    try:
        cell = base.with_overrides(**given)
    except ConfigError as exc:
        flag = "--" + exc.setting.replace("_", "-")
        shown = redact(given[exc.setting]) if exc.setting == "redis_url" else given[exc.setting]
        raise ConfigError(flag, f"{shown!r} refused ({exc})") from None
    return Invocation(args, cell, redis_url_given="redis_url" in given or ENV_VARS["redis_url"] in env)
