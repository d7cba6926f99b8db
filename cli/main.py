"""``rollout-fleet``: worker, demo, redis, status, supervisor, gateway, replay, sessions, trainers, update-weights,
ray and bench.

The verbs' arguments are in :mod:`cli.args`; this module runs them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from broker.redis.config import ConfigError
from broker.redis.connect import open_redis
from cli.args import WORKER_SETTINGS, Invocation, build_parser, gateway_settings, resolve
from cli.checks import check_invocation
from cli.env import EnvError, apply_env, subparsers
from cli.errors import UsageError, one_line
from cli.logs import configure_logging


def _shape(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(x) for x in text.split(","))


def _parse_opts(items: Sequence[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-opt expects KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = _parse_opts(getattr(args, "engine_opt", []))
    shape = _shape(getattr(args, "latent_shape", None))
    if args.engine == "reference":
        if getattr(args, "device", None):
            opts["device"] = args.device
        if shape:
            opts["latent_shape"] = shape
    elif shape:
        opts["latent_shape"] = shape
    return opts


def _cmd_worker(run: Invocation) -> int:
    from broker.ops.metrics import MetricsPortError
    from workers.runner import run_worker
    from workers.settings import WorkerSettings

    args = run.args
    own = {name: getattr(args, name) for name in WORKER_SETTINGS}
    settings = WorkerSettings.from_mapping({**dataclasses.asdict(run.cell), **own})
    try:
        run_worker(args.engine, settings, _engine_options(args))
    except MetricsPortError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_demo(run: Invocation) -> int:
    from cli.demo import DemoConfig, run_demo

    args = run.args
    config = DemoConfig(cell_config=run.cell, embedded_redis=not run.redis_url_given, workers=args.workers,
                        sessions=args.sessions, steps=args.steps, mode=args.mode, engine=args.engine,
                        engine_options=_engine_options(args), progress=not args.no_progress,
                        kill_one=args.kill_one, metrics_port=args.metrics_port)
    return run_demo(config)


def _cmd_redis(run: Invocation) -> int:
    """One redis-server in the foreground until Ctrl-C / SIGTERM. A port something else listens on
    (a system Redis on 6379) is one line and exit 2, never "listening": the fleet would quietly
    share somebody else's Redis."""
    from broker.redis.embedded import PortTaken, RedisServer, RedisStartError

    args = run.args
    if args.cluster:
        return _run_cluster()
    try:
        server = RedisServer(port=args.port, directory=args.dir, appendonly=args.appendonly).start()
    except PortTaken as exc:
        raise UsageError(f"{exc}; choose another --port, or point the fleet at that Redis with --redis-url") from None
    except (RedisStartError, TimeoutError) as exc:
        raise UsageError(str(exc)) from None
    print(f"redis listening at {server.url} (data in {server.directory}); Ctrl-C to stop", flush=True)
    assert server.process is not None
    process = server.process
    try:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        code = process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.cleanup()
    print(f"rollout-fleet redis: error: redis-server exited by itself with {code}", file=sys.stderr)
    return 1


def _run_cluster() -> int:
    """A local 3+3 Redis Cluster in the foreground, until Ctrl-C / SIGTERM or a node exits."""
    from broker.redis.embedded_cluster import RedisCluster

    cluster = RedisCluster()
    try:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        cluster.start()
        print(f"redis cluster listening at {cluster.url}; Ctrl-C to stop", flush=True)
        while len(cluster.running()) == len(cluster.nodes):
            time.sleep(1.0)  # Ctrl-C / SIGTERM interrupt the sleep
    except KeyboardInterrupt:
        pass
    finally:
        cluster.cleanup()
    return 0


def _cmd_status(run: Invocation) -> int:
    from cli.status import run_status_command

    return run_status_command(run.cell, run.args)


def _cmd_supervisor(run: Invocation) -> int:
    from broker.ops.metrics import MetricsPortError
    from broker.ops.supervisor import SupervisorSettings, run_supervisor

    try:
        run_supervisor(SupervisorSettings(cell_config=run.cell, interval_s=run.args.interval_s,
                                          metrics_port=run.args.metrics_port))
    except MetricsPortError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_replay(run: Invocation) -> int:
    from cli.replay import run_replay_command

    return asyncio.run(run_replay_command(run.cell, run.args))


def _cmd_sessions(run: Invocation) -> int:
    from cli.sessions import run_sessions_command

    return asyncio.run(run_sessions_command(run.cell, run.args))


def _cmd_cells(run: Invocation) -> int:
    from cli.cells import run_cells_command

    return asyncio.run(run_cells_command(run.cell, run.args))


def _cmd_trainers(run: Invocation) -> int:
    from cli.trainers import run_trainers_command

    return asyncio.run(run_trainers_command(run.cell, run.args))


def _cmd_ray(run: Invocation) -> int:
    from cli.ray import run_ray_command

    return run_ray_command(run.cell, run.args)


def _cmd_update_weights(run: Invocation) -> int:
    from redis.exceptions import RedisError

    from broker.ops.weights import WeightUpdateFailed, update_weights_in_cells

    args = run.args

    async def go() -> None:
        if args.abort_in_flight and args.in_flight not in (None, "abort"):
            raise ValueError(f"--abort-in-flight contradicts --in-flight {args.in_flight}")
        in_flight = args.in_flight or ("abort" if args.abort_in_flight else "finish")
        redis = open_redis(run.cell.redis_url)
        try:
            await update_weights_in_cells(redis, run.cell, model=args.model, version=args.version, path=args.path,
                                          in_flight=in_flight, allow_unserved=args.allow_unserved, wait_s=args.wait)
        finally:
            await redis.aclose()

    try:
        asyncio.run(go())
    except WeightUpdateFailed as exc:  # a worker stored why it could not load them: no use waiting
        print(f"update-weights: failed: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TimeoutError, RedisError, OSError) as exc:  # bad input, no Redis, --wait ran out
        print(f"update-weights: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_gateway(run: Invocation) -> int:
    from broker.gateway import serve

    settings = gateway_settings(run.args)
    if not settings.api_keys and run.args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("gateway on %s without API keys: any client may use it", run.args.host)
    serve(run.cell, run.args.host, run.args.port, model_default=run.args.model, settings=settings)
    return 0


def _cmd_dashboard(run: Invocation) -> int:
    from cli.args import dashboard_settings

    try:
        from broker.gateway.dashboard import serve_dashboard
    except ModuleNotFoundError as exc:  # the web server is an extra
        print(f"dashboard: {exc.name} is missing: install rollout-fleet[gateway]", file=sys.stderr)
        return 2
    serve_dashboard(run.cell, run.args.host, run.args.port, settings=dashboard_settings(run.args))
    return 0


BENCH_STOP_S = 60.0  # after a forwarded signal: the bench stops its workers (15 s grace) and writes its results


def _cmd_bench(run: Invocation) -> int:
    # bench/ sits above workers/ (it drives worker processes): run it as its own program rather
    # than import it, so that imports between the packages run one way.
    # Its own process group: a Ctrl-C at the terminal reaches this process only, which passes it
    # on once (two SIGINTs would cut the bench's clean-up short); the group is what a kill ends.
    bench = subprocess.Popen([sys.executable, "-m", "bench.run_all", *run.args.passthrough], start_new_session=True)
    return _wait_forwarding(bench, BENCH_STOP_S)


def _wait_forwarding(child: subprocess.Popen[bytes], stop_s: float) -> int:
    """``child``'s exit status. The first SIGINT / SIGTERM here is passed on to it; when it has not
    exited ``stop_s`` later, or at a second signal, its process group (its workers and its Redis
    with it) is killed."""
    got: list[float] = []

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    def forward(signum: int, _frame: object) -> None:
        if got:
            kill_group()  # a second signal: now
            return
        got.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if got and time.monotonic() - got[0] > stop_s:
                    print(f"rollout-fleet bench: still running {stop_s:g} s after the signal: killed", file=sys.stderr)
                    kill_group()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


COMMANDS: dict[str, Callable[[Invocation], int]] = {
    "worker": _cmd_worker, "demo": _cmd_demo, "redis": _cmd_redis, "status": _cmd_status,
    "supervisor": _cmd_supervisor, "replay": _cmd_replay, "gateway": _cmd_gateway,
    "bench": _cmd_bench, "update-weights": _cmd_update_weights, "dashboard": _cmd_dashboard,
    "sessions": _cmd_sessions, "cells": _cmd_cells, "trainers": _cmd_trainers, "ray": _cmd_ray,
}


def parse_invocation(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Invocation:
    """The verb's options from the command line, else the environment, else the defaults. A
    mistake exits 2 with one line naming the option or the variable."""
    parser = build_parser(environ)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    verb_parser = subparsers(parser)[args.command]
    try:
        # Which options the environment set: a filter taken from there says so (cli.env).
        args.from_env = {**apply_env(parser, args), **apply_env(verb_parser, args)}
        run = resolve(args, environ)
        check_invocation(run)
    except (ConfigError, EnvError, UsageError) as exc:
        verb_parser.error(str(exc))
    return run


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run one verb. ``environ`` (default: ``os.environ``) gives every option its default
    (:mod:`cli.env`): the one place the fleet reads its environment."""
    run = parse_invocation(argv, os.environ if environ is None else environ)
    args = run.args
    configure_logging(args.log_level, args.log_format)
    redis_url = run.cell.redis_url if hasattr(args, "redis_url") else None
    return one_line(args.command, redis_url, lambda: COMMANDS[args.command](run))


if __name__ == "__main__":
    sys.exit(main())
