"""The supervisor's passes scheduled without arq, for a Redis Cluster (docs/cluster.md says why
arq cannot run there).

One asyncio loop runs the same per-pass functions arq's cron jobs run (``reap_job``,
``trim_job`` of :mod:`broker.ops.supervisor`), each every ``every_s`` seconds. Before a pass, a
supervisor claims it for the period with SET NX PX on a key of the cell (so in the cell's slot, on
the cell's master): of all the supervisors of a cell, one runs each pass per period, as arq's
unique cron job ids ensure on a single node. A supervisor that dies mid-pass loses nothing: the
claim lapses with the period, and every move of a pass is a fenced, idempotent script.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.backoff import REDIS_ERRORS, Backoff, wait_set

log = logging.getLogger(__name__)
PASS_TIMEOUT_S = 60.0  # the bound arq puts on each cron job (timeout=60), kept here


@dataclass(frozen=True)
class Pass:
    name: str  # letters and digits: it names the claim key
    every_s: float
    run: Callable[[dict[str, Any]], Awaitable[Any]]


async def claim(redis: Redis, key: str, period_ms: int) -> bool:
    """Whether this process runs this period's pass claimed at ``key`` (the claim is left to lapse)."""
    return bool(await redis.set(key, uuid.uuid4().hex, nx=True, px=period_ms))


async def run_passes(ctx: dict[str, Any], passes: list[Pass], stop: asyncio.Event) -> None:
    """Run each pass when it is due and claimed, until ``stop`` is set. A Redis outage (a master
    failing over) waits with backoff and tries again; a pass that outlives PASS_TIMEOUT_S is cut."""
    redis: Redis = ctx["fleet_redis"]
    claim_key: Callable[[str], str] = ctx["pass_claim"]  # the cell's claim, or the deployment's for every cell
    loop = asyncio.get_running_loop()
    due = {p.name: loop.time() for p in passes}
    backoff = Backoff()
    while not stop.is_set():
        try:
            for p in passes:
                if loop.time() >= due[p.name]:
                    due[p.name] = loop.time() + p.every_s
                    await _run_claimed(ctx, redis, claim_key(p.name), p)
            backoff.reset()
            pause = max(0.0, min(due.values()) - loop.time())
        except REDIS_ERRORS as exc:
            log.warning("supervisor pass: redis unavailable (%s); retrying in %.2fs", exc, backoff.delay)
            pause = backoff.take()
        await wait_set(stop, pause)


async def _run_claimed(ctx: dict[str, Any], redis: Redis, key: str, p: Pass) -> None:
    if not await claim(redis, key, max(1, int(p.every_s * 1000))):
        return  # another supervisor of this cell runs this period's pass
    try:
        async with asyncio.timeout(PASS_TIMEOUT_S):
            outcome = await p.run(ctx)
    except TimeoutError:
        log.warning("supervisor pass %s took over %.0fs; cut short (the next period runs it again)",
                    p.name, PASS_TIMEOUT_S)
        return
    except REDIS_ERRORS:
        raise  # the loop backs off
    except Exception:  # as arq does with a failing cron job: log it, keep supervising
        log.exception("supervisor pass %s failed", p.name)
        return
    log.debug("supervisor pass %s: %s", p.name, outcome)
