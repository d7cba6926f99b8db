"""``rollout-fleet ray up|status|scale|down``: the fleet's workers on a Ray cluster.

The verbs call :class:`workers.ray_fleet.RayFleet` (what a trainer's driver calls from Python) and
print what it answers. The workers' environment is built here, at the edge: the cell (the Redis
URL, its password included), the engine and its options, the drain timeout, and any variable
``--worker-env`` names, all as ``ROLLOUT_FLEET_*`` (or named) variables, never on a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

from broker.redis.config import CellConfig
from cli.errors import UsageError

ACTIONS = ("up", "status", "scale", "down")


def run_ray_command(cell: CellConfig, args: argparse.Namespace) -> int:
    """0 when done; 1 when ``up``/``scale`` placed the workers but not all became live in the
    cell within ``--wait``; expected failures (no Ray, no cluster, no fleet, no room) exit 2."""
    from workers.ray_fleet import RayFleet, RayFleetError  # imports no Ray: a missing Ray is one line (cli.errors)

    fleet = RayFleet(_name(args.name), address=args.address)
    try:
        return _ACTIONS[args.action](fleet, cell, args, args.environ)
    except RayFleetError as exc:
        raise UsageError(f"ray {args.action}: {exc}") from None


def _name(name: str) -> str:
    from workers.ray_fleet.spec import check_name

    try:
        return check_name(name)
    except ValueError as exc:
        raise UsageError(f"--name: {exc}") from None


def _up(fleet: Any, cell: CellConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from workers.ray_fleet import FleetSpec

    autoscale = _autoscale(args)
    workers = args.workers if args.workers is not None or autoscale is None else autoscale.min_workers
    if workers is None:
        raise UsageError("ray up needs --workers N ($ROLLOUT_FLEET_RAY_WORKERS)")
    if cell.any_cell:
        raise UsageError("--cell '*' ($ROLLOUT_FLEET_CELL): a worker joins one cell; give it a name")
    try:
        spec = FleetSpec(worker_env=_worker_env(cell, args, environ), num_gpus=args.num_gpus, num_cpus=args.num_cpus,
                         placement=args.placement, drain_timeout_s=args.drain_timeout_s, autoscale=autoscale)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fleet.up(spec, workers)
    return _settle(fleet, cell, args, workers)


def _autoscale(args: argparse.Namespace) -> Any:
    """The autoscaling of ``up`` (--min-workers and --max-workers, both or neither), else None."""
    from workers.ray_fleet import Autoscale

    if args.min_workers is None and args.max_workers is None:
        return None
    if args.min_workers is None or args.max_workers is None:
        raise UsageError("autoscaling needs both --min-workers and --max-workers")
    try:
        return Autoscale(min_workers=args.min_workers, max_workers=args.max_workers, target_fill=args.target_fill)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _worker_env(cell: CellConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    from workers.ray_fleet import worker_env

    for item in args.engine_opt:
        if not item.partition("=")[0] or "=" not in item:
            raise UsageError(f"--engine-opt expects KEY=VALUE, got {item!r}")
    missing = [name for name in args.worker_env if name not in environ]
    if missing:
        raise UsageError(f"--worker-env: {', '.join(missing)} not set in this environment")
    return worker_env(cell, args.engine, engine_options=args.engine_opt, drain_timeout_s=args.drain_timeout_s,
                      gpu=args.num_gpus > 0, serve_results=args.serve_results,
                      extra={name: environ[name] for name in args.worker_env})


def _status(fleet: Any, cell: CellConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    _show(fleet.status(), cell, args.json)
    return 0


def _scale(fleet: Any, cell: CellConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    if args.workers is None:
        raise UsageError("ray scale needs --workers N ($ROLLOUT_FLEET_RAY_WORKERS)")
    fleet.scale(args.workers)
    return _settle(fleet, cell, args, args.workers)


def _down(fleet: Any, cell: CellConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    outcome = fleet.down()
    if args.json:
        print(json.dumps({"name": fleet.name, "drained": {str(k): v for k, v in outcome.items()}}, sort_keys=True))
    else:
        killed = sorted(i for i, code in outcome.items() if code != 0)
        print(f"fleet {fleet.name}: {len(outcome)} workers drained and stopped"
              + (f" ({len(killed)} not cleanly: workers {killed}; their leases move their sessions)" if killed else ""))
    return 0


def _settle(fleet: Any, cell: CellConfig, args: argparse.Namespace, count: int) -> int:
    """Wait (``--wait``) until ``count`` workers are live in the cell, then show the fleet."""
    from workers.ray_fleet import wait_live

    code = 0
    try:
        asyncio.run(wait_live(cell, fleet, count, args.wait))
    except TimeoutError as exc:
        print(f"rollout-fleet ray {args.action}: {exc}; see the workers' logs in Ray (ray logs, or the "
              "dashboard)", file=sys.stderr)
        code = 1
    _show(fleet.status(), cell, args.json)
    return code


def _show(report: Any, cell: CellConfig, as_json: bool) -> None:
    from workers.ray_fleet import live_in_cell

    live = asyncio.run(live_in_cell(cell, report.worker_ids))
    rows = [{**row, "live": row.get("worker_id") in live} for row in report.workers]
    if as_json:
        print(json.dumps({"name": report.name, "spec": report.spec, "workers": rows}, sort_keys=True))
        return
    spec = report.spec
    print(f"fleet {report.name}: {len(rows)} workers ({spec['engine']}, {spec['num_gpus']:g} GPU and "
          f"{spec['num_cpus']:g} CPU each, {spec['placement']}); {len(live)} live in cell {cell.cell}")
    print(f"{'index':>5}  {'node':<12}  {'pid':>7}  {'state':<11}  worker")
    for row in rows:
        print(f"{row['index']:>5}  {str(row.get('node_id', ''))[:12]:<12}  {row.get('pid') or '-':>7}  "
              f"{_state(row):<11}  {row.get('worker_id', '')}")


def _state(row: Mapping[str, Any]) -> str:
    if not row.get("reachable"):
        return "restarting"  # its node or process was lost: Ray restarts it (max_restarts)
    if row.get("draining"):
        return "draining"
    if row["live"]:
        return "live"
    return "starting" if row.get("running") else "exited"


_Action = Callable[[Any, CellConfig, argparse.Namespace, Mapping[str, str]], int]
_ACTIONS: dict[str, _Action] = {"up": _up, "status": _status, "scale": _scale, "down": _down}
