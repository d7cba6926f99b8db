"""``rollout-fleet``: worker, demo, redis (embedded, foreground) and status commands."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from broker.client import DEFAULT_URL
from workers.engines.registry import ENGINE_HELP, engine_name


def _add_redis(p: argparse.ArgumentParser, default: str | None = DEFAULT_URL) -> None:
    p.add_argument("--redis-url", default=default, help=f"Redis URL (default: {default or 'embedded'})")
    p.add_argument("--prefix", default="rf", help="key prefix (default: rf)")
    p.add_argument("--cell", default="0", help="cell hash tag (default: 0)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-fleet", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run a worker process")
    _add_redis(w)
    w.add_argument("--engine", type=engine_name, default="reference", help=ENGINE_HELP)
    w.add_argument("--device", default=None, help="reference engines: cpu (default) or cuda")
    w.add_argument("--latent-shape", default=None, help="reference world latent shape, e.g. 1,16,2,44,80")
    w.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (value parsed as JSON when it can be), repeatable")
    w.add_argument("--worker-id", default=None)
    w.add_argument("--capacity", type=int, default=256, help="sessions this worker may own")
    w.add_argument("--heartbeat-ms", type=int, default=1000)
    w.add_argument("--lease-ms", type=int, default=5000)
    w.add_argument("--max-attempts", type=int, default=3)
    w.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight jobs")

    d = sub.add_parser("demo", help="a local fleet: embedded Redis, worker processes and a trainer loop")
    _add_redis(d, default=None)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--sessions", type=int, default=16)
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--mode", choices=("world_model_env", "tokens", "both"), default="both")
    d.add_argument("--engine", type=engine_name, default="reference", help=ENGINE_HELP)
    d.add_argument("--latent-shape", default=None, help="world latent shape (default 1,16,2,44,80)")
    d.add_argument("--no-progress", action="store_true")

    r = sub.add_parser("redis", help="run the embedded Redis server in the foreground")
    r.add_argument("--port", type=int, default=6379)
    r.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    r.add_argument("--appendonly", action="store_true", help="AOF with appendfsync always")

    s = sub.add_parser("status", help="workers and sessions of a cell, from Redis alone")
    _add_redis(s)

    sv = sub.add_parser("supervisor", help="arq supervisor: lease reaper/failover, trimming, replay jobs")
    _add_redis(sv)
    sv.add_argument("--lease-ms", type=int, default=5000, help="must match the workers' lease")
    sv.add_argument("--interval", type=int, default=1, help="seconds between reaping passes")

    gw = sub.add_parser("gateway", help="vLLM-Omni-compatible HTTP rollout API in front of the fleet")
    _add_redis(gw)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)

    # Its options are bench.run_all's own (--size, --only, --plot, ...): passed through untouched.
    sub.add_parser("bench", help="benchmarks beside their anchors (arq, streaq, HTTP); prints a table",
                   add_help=False)

    uw = sub.add_parser("update-weights", help="tell the workers of a model to load new weights")
    _add_redis(uw)
    uw.add_argument("--model", required=True)
    uw.add_argument("--version", type=int, required=True, help="policy version (>= 1, increasing)")
    uw.add_argument("--path", required=True, help="weights path as the workers see it")
    uw.add_argument("--wait", type=float, default=0.0, help="seconds to wait until every worker reports it")
    uw.add_argument("--abort-in-flight", action="store_true",
                    help="abort running steps (they run again on the new weights) instead of letting them finish")

    rp = sub.add_parser("replay", help="list, show and re-enqueue dead-lettered jobs")
    _add_redis(rp)
    rp.add_argument("action", choices=("list", "show", "run"))
    rp.add_argument("ids", nargs="*", help="dead-letter entry ids (show/run)")
    rp.add_argument("--session", default=None)
    rp.add_argument("--code", default=None, help="error code, e.g. inference_error")
    rp.add_argument("--older-than", type=float, default=None, help="seconds")
    rp.add_argument("--newer-than", type=float, default=None, help="seconds")
    rp.add_argument("--limit", type=int, default=1000)
    rp.add_argument("--dry-run", action="store_true")
    rp.add_argument("--json", action="store_true", help="print JSON lines")
    return parser


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


def _cmd_worker(args: argparse.Namespace) -> int:
    from workers.runner import run_worker
    from workers.settings import WorkerSettings

    settings = WorkerSettings.from_mapping({
        "redis_url": args.redis_url, "prefix": args.prefix, "cell": args.cell, "worker_id": args.worker_id,
        "capacity": args.capacity, "heartbeat_ms": args.heartbeat_ms, "lease_ms": args.lease_ms,
        "max_attempts": args.max_attempts, "drain_timeout_s": args.drain_timeout,
    })
    run_worker(args.engine, settings, _engine_options(args))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from workers.demo import DemoConfig, run_demo

    config = DemoConfig(redis_url=args.redis_url, prefix=args.prefix, workers=args.workers,
                        sessions=args.sessions, steps=args.steps, mode=args.mode, engine=args.engine,
                        engine_options=_engine_options(args),
                        progress=not args.no_progress)
    return run_demo(config)


def _cmd_redis(args: argparse.Namespace) -> int:
    from broker.redis.embedded import RedisServer

    server = RedisServer(port=args.port, directory=args.dir, appendonly=args.appendonly).start()
    print(f"redis listening at {server.url} (data in {server.directory}); Ctrl-C to stop", flush=True)
    try:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.cleanup()
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from broker.ops.status import cell_status, format_status

    report = asyncio.run(cell_status(args.redis_url, prefix=args.prefix, cell=args.cell))
    print(format_status(report))
    return 0


def _cmd_supervisor(args: argparse.Namespace) -> int:
    from broker.ops.supervisor import SupervisorSettings, run_supervisor

    run_supervisor(SupervisorSettings(redis_url=args.redis_url, prefix=args.prefix, cell=args.cell,
                                      lease_ms=args.lease_ms, interval_s=args.interval))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from broker.ops.replay_cli import run_replay_command

    return asyncio.run(run_replay_command(args))


def _cmd_update_weights(args: argparse.Namespace) -> int:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    from broker.ops.weights import update_weights, workers_at_version
    from broker.redis.keys import CellKeys

    async def go() -> None:
        redis = Redis.from_url(args.redis_url)
        keys = CellKeys(args.prefix, args.cell)
        try:
            entry = await update_weights(redis, keys, model=args.model, version=args.version, path=args.path,
                                         in_flight="abort" if args.abort_in_flight else "finish")
            print(f"announced {args.model} version {args.version} ({entry})")
            if args.wait:
                done = await workers_at_version(redis, keys, model=args.model, version=args.version,
                                                timeout=args.wait)
                print(f"{len(done)} workers serve version {args.version}")
        finally:
            await redis.aclose()

    try:
        asyncio.run(go())
    except (ValueError, TimeoutError, RedisError, OSError) as exc:  # bad input, no Redis, --wait ran out
        print(f"update-weights: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    from broker.gateway import serve

    serve(args.redis_url, args.host, args.port, args.prefix, args.cell)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # bench/ sits above workers/ (it drives worker processes): run it as its own program rather
    # than import it, so that imports between the packages run one way.
    import subprocess

    return subprocess.call([sys.executable, "-m", "bench.run_all", *args.passthrough])


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"worker": _cmd_worker, "demo": _cmd_demo, "redis": _cmd_redis, "status": _cmd_status,
                "supervisor": _cmd_supervisor, "replay": _cmd_replay, "gateway": _cmd_gateway,
                "bench": _cmd_bench, "update-weights": _cmd_update_weights}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
