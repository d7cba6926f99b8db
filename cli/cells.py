"""``rollout-fleet cells [list|suggest]``: the deployment's cells and where their slots live.

``list``: every cell of the registry (:mod:`broker.redis.cells`) with its slot, the master that
serves the slot, whether a worker of it is live and its newest heartbeat's age. ``suggest --count
N``: N cell names whose slots belong to N different masters (:func:`broker.redis.slots.cells_on_distinct_masters`),
so the cells' scripts spread over the cluster's CPUs; a Redis without cluster mode is one master.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from broker.redis.cells import CELL_FORGET_MS, redis_now_ms
from broker.redis.config import CellConfig
from broker.redis.connect import is_cluster, open_redis
from broker.redis.keys import cell_problem
from broker.redis.slots import SLOTS, SlotRange, cell_slot, cells_on_distinct_masters, master_of

REDIS_TIMEOUT_S = 5.0
SINGLE_MASTER = "this server (no cluster mode)"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


async def slot_ranges(redis: Redis) -> list[SlotRange]:
    """The masters' slot ranges from ``CLUSTER SLOTS`` (a master is named by its node id, else
    host:port); a Redis without cluster mode serves every slot itself."""
    try:
        raw: Any = await _cluster_slots(redis)
    except ResponseError as exc:
        if "cluster support disabled" not in str(exc):
            raise
        return [(0, SLOTS - 1, SINGLE_MASTER)]
    ranges = []
    for first, last, master, *_replicas in raw:
        host, port = _text(master[0]), int(master[1])
        name = _text(master[2]) if len(master) > 2 else f"{host}:{port}"
        ranges.append((int(first), int(last), name))
    return ranges


async def _cluster_slots(redis: Redis) -> Any:
    """``CLUSTER SLOTS`` as the server answers it. A cluster client is told which node to ask (it
    cannot route a command without keys), and its parsed answer is turned back into the reply."""
    if not is_cluster(redis):
        return await redis.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    cluster = cast(RedisCluster, redis)
    await cluster.initialize()
    answer: Any = await cluster.execute_command("CLUSTER", "SLOTS", target_nodes=cluster.get_random_node())
    if not isinstance(answer, dict):
        return answer
    return [[first, last, [*info["primary"]], *info.get("replicas", [])] for (first, last), info in answer.items()]


async def _list(redis: Redis, config: CellConfig, ranges: list[SlotRange]) -> list[dict[str, Any]]:
    now = await redis_now_ms(redis)
    raw: Any = await redis.zrangebyscore(config.deployment_keys.cells, now - CELL_FORGET_MS, "+inf", withscores=True)
    rows = []
    for cell, beat in sorted(raw, key=lambda pair: _text(pair[0])):
        name, age = _text(cell), now - int(beat)
        rows.append({"cell": name, "slot": cell_slot(name), "master": master_of(cell_slot(name), ranges),
                     "live": age <= config.lease_ms, "heartbeat_age_ms": age})
    return rows


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"cells": rows}, sort_keys=True))
        return
    print(f"{'cell':<24} {'slot':>5} {'live':<5} {'beat_ms':>10} master")
    for r in rows:
        print(f"{r['cell']:<24} {r['slot']:>5} {'yes' if r['live'] else 'NO':<5} {r['heartbeat_age_ms']:>10} "
              f"{r['master'] or '?'}")
    print(f"{len(rows)} cell(s)")


async def run_cells_command(config: CellConfig, args: argparse.Namespace) -> int:
    """0 when shown; 2 (one line on stderr) when no such set of cell names exists. A Redis error
    goes up to the CLI, which says it in one line (the password left out) with exit 2."""
    redis = open_redis(config.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        try:
            ranges = await slot_ranges(redis)
        except NoPermissionError:  # the fleet's ACL user may not run CLUSTER SLOTS (docs/security.md)
            if args.action != "list":
                print("cells suggest: this Redis user may not run CLUSTER SLOTS; use a user that may",
                      file=sys.stderr)
                return 2
            ranges = []  # the list shows no masters then
        if args.action == "list":
            _print_rows(await _list(redis, config, ranges), args.json)
            return 0
        try:
            problem = cell_problem(f"{args.stem}0")
            if problem is not None:
                raise ValueError(f"--stem {args.stem!r} makes no cell name: {problem}")
            names = cells_on_distinct_masters(ranges, args.count, stem=args.stem)
        except ValueError as exc:
            print(f"cells suggest: {exc}", file=sys.stderr)
            return 2
        rows = [{"cell": n, "slot": cell_slot(n), "master": master_of(cell_slot(n), ranges)} for n in names]
        if args.json:
            print(json.dumps({"cells": rows}, sort_keys=True))
        else:
            for r in rows:
                print(f"{r['cell']:<24} slot {r['slot']:>5} on {r['master']}")
        return 0
    finally:
        await redis.aclose()
