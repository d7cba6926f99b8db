"""The supervisor: an arq worker whose cron jobs keep a cell healthy, or every cell (``--cell '*'``:
each pass runs in every cell of the registry, :func:`broker.redis.cells.known_cells`). On a Redis
Cluster, where arq cannot run, the same passes run on the fleet's own schedule
(:mod:`broker.ops.pass_loop`).

- ``reap`` (every ``interval`` s): fail over the sessions of workers whose lease expired, then
  retire those workers (see :mod:`broker.ops.failover`).
- ``trim`` (every 30 s): forget closed sessions that expired, bound the dead-letter stream.
- ``replay_dead`` (on request): replay dead-lettered jobs as an arq job (:func:`request_replay`).

Jobs are msgpack, never pickle (:mod:`broker.ops.arq_queue`): a job that is not msgpack is refused
without being run. Several supervisors may run: arq gives each cron tick one job id (unique), a Redis lock makes a
reaping pass exclusive, and every move is an idempotent, fenced Lua script anyway. Workers do not
need a supervisor: each worker also reaps under the same lock (``workers/reaper.py``), so failover
works with none; the supervisor adds trimming and replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

from arq import cron
from arq.worker import Worker as ArqWorker

from broker.ops.arq_queue import arq_pool, pack_arq, unpack_arq
from broker.ops.failover import reap_exclusively
from broker.ops.metrics import FleetMetrics, serve_metrics
from broker.ops.pass_loop import Pass, run_passes
from broker.ops.replay import list_dead, replay
from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS, wait_set
from broker.redis.cells import cells_of
from broker.redis.config import CellConfig
from broker.redis.connect import is_cluster_url, open_redis
from broker.redis.keys import CellKeys
from broker.redis.layouts import DEAD_LETTER_MAXLEN
from broker.redis.memory_policy import warn_if_evicting
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
RESTART_PAUSE_S = 1.0  # between a Redis error that ended arq's loop and the next start
TRIM_EVERY_S = 30  # arq runs the trim pass at seconds 0 and 30 of every minute


class ArqOnClusterError(RuntimeError):
    """arq's queue cannot run on a Redis Cluster (docs/cluster.md); the message says what to use."""


@dataclass(frozen=True)
class SupervisorSettings:
    cell_config: CellConfig = field(default_factory=CellConfig)  # lease_ms must match the workers'
    interval_s: int = 1
    metrics_port: int | None = None  # serve /metrics here; None: no metrics server


def queue_name(config: CellConfig) -> str:
    """The arq queue of the supervisors of ``config``'s cell, or of every cell."""
    return config.deployment_keys.arq_queue if config.any_cell else config.keys.arq_queue


async def _startup(ctx: dict[str, Any]) -> None:
    settings: SupervisorSettings = ctx["settings"]
    ctx["fleet_redis"] = open_redis(settings.cell_config.redis_url)
    ctx.setdefault("metrics", FleetMetrics())
    await warn_if_evicting(ctx["fleet_redis"], "supervisor")  # broker/redis/memory_policy.py


async def cell_scripts(ctx: dict[str, Any]) -> list[Scripts]:
    """The scripts of every cell this supervisor looks after: its one cell, or every known cell."""
    config: CellConfig = ctx["settings"].cell_config
    cells = await cells_of(ctx["fleet_redis"], config)
    scripts: dict[str, Scripts] = ctx.setdefault("cell_scripts", {})
    for cell in cells:
        if cell not in scripts:
            scripts[cell] = Scripts(ctx["fleet_redis"], CellKeys(config.prefix, cell))
    return [scripts[cell] for cell in cells]


async def _shutdown(ctx: dict[str, Any]) -> None:
    await ctx["fleet_redis"].aclose()


async def reap_job(ctx: dict[str, Any]) -> dict[str, Any]:
    settings: SupervisorSettings = ctx["settings"]
    metrics: FleetMetrics = ctx["metrics"]
    done: dict[str, Any] = {"workers": [], "skipped": []}
    for scripts in await cell_scripts(ctx):
        reports = await reap_exclusively(scripts, lease_ms=settings.cell_config.lease_ms)
        if reports is None:
            done["skipped"].append(scripts.keys.cell)  # another process is reaping this cell
            continue
        for r in reports:
            log.warning("worker %s of cell %s lease expired: %d sessions moved (%d jobs), %d waiting, retired=%s",
                        r.worker_id, scripts.keys.cell, len(r.moved), r.jobs_moved, len(r.stuck), r.retired)
            metrics.failovers.inc(len(r.moved))
        done["workers"] += [asdict(r) for r in reports]
        await _count_dead_letters(ctx, scripts)
    return done


async def _count_dead_letters(ctx: dict[str, Any], scripts: Scripts) -> None:
    """``rollout_fleet_dead_letters_total`` grows by the entries added to the cell's dead-letter
    stream since the last pass (XINFO's entries-added: trimming does not lower it, XLEN would)."""
    added = 0
    if await scripts.redis.exists(scripts.keys.dead):
        info: Any = await scripts.redis.xinfo_stream(scripts.keys.dead)
        added = int(info.get("entries-added", info.get(b"entries-added", 0)))
    seen_by_cell: dict[str, int] = ctx.setdefault("dead_letters_seen", {})
    seen = seen_by_cell.get(scripts.keys.cell)
    if seen is not None and added != seen:
        # Fewer than seen: the stream was deleted and made again, and all it holds is new.
        ctx["metrics"].dead_letters.inc(added - seen if added > seen else added)
    seen_by_cell[scripts.keys.cell] = added  # the first pass only sets the baseline: earlier ones are history


async def trim_job(ctx: dict[str, Any]) -> dict[str, int]:
    """Forget expired sessions, bound the dead letters (in every cell); the sessions gauge counts
    what is left."""
    done = {"sessions_forgotten": 0, "dead_letters_trimmed": 0}
    by_model: dict[str, int] = {}
    for scripts in await cell_scripts(ctx):
        done["sessions_forgotten"] += await _forget_expired(scripts, by_model)
        done["dead_letters_trimmed"] += int(await scripts.redis.xtrim(scripts.keys.dead, maxlen=DEAD_LETTER_MAXLEN,
                                                                      approximate=True))
    metrics: FleetMetrics = ctx["metrics"]
    for name in set(by_model) | set(ctx.get("models_seen", ())):
        metrics.sessions.labels(name).set(by_model.get(name, 0))
    ctx["models_seen"] = set(by_model) | set(ctx.get("models_seen", ()))
    return done


async def _forget_expired(scripts: Scripts, by_model: dict[str, int]) -> int:
    """Drop the cell's index entries of sessions that expired; count the others by model."""
    redis, keys = scripts.redis, scripts.keys
    forgotten = 0
    async for sid, _owner in redis.hscan_iter(keys.sessions):
        model: Any = await resolve(redis.hget(keys.session(sid.decode()), "model"))
        if model is None:
            forgotten += await resolve(redis.hdel(keys.sessions, sid))
        else:
            name = model.decode() if isinstance(model, bytes) else str(model)
            by_model[name] = by_model.get(name, 0) + 1
    return forgotten


async def replay_dead(ctx: dict[str, Any], filters: dict[str, Any], dry_run: bool = False) -> list[dict[str, Any]]:
    outcomes: list[dict[str, Any]] = []
    for scripts in await cell_scripts(ctx):
        jobs = await list_dead(scripts, **filters)
        outcomes += [asdict(o) for o in await replay(scripts, jobs, dry_run=dry_run)]
    return outcomes


class SupervisorWorker(ArqWorker):
    """arq's worker with a close that a stop during a pass survives.

    arq's signal handler cancels the jobs still running and its ``close`` then gathers them, so a
    SIGTERM landing during a reap or trim pass raised their CancelledError out of ``run()``: the
    supervisor exited with a traceback and without its ``on_shutdown``. A cancelled pass is
    harmless (each script is atomic; the next pass does the rest), so the jobs are settled first.
    """

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()  # what arq's signal handler did already, or its close would do
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()
        await super().close()


def build_worker(settings: SupervisorSettings, *, handle_signals: bool = True,
                 metrics: FleetMetrics | None = None) -> SupervisorWorker:
    queue = queue_name(settings.cell_config)
    every = set(range(0, 60, max(1, settings.interval_s)))
    return SupervisorWorker(
        functions=[replay_dead],
        cron_jobs=[
            # arq's cron job ids are "<name>:<tick>" under its fixed arq:job: / arq:in-progress:
            # keys, shared by every cell on this Redis: the cell's queue in the name keeps one
            # cell's tick from being taken for another's (which then skipped its pass).
            cron(reap_job, name=f"{queue}:reap", second=every, run_at_startup=True, unique=True,
                 timeout=60),
            cron(trim_job, name=f"{queue}:trim", second=set(range(0, 60, TRIM_EVERY_S)), unique=True,
                 timeout=60),
        ],
        queue_name=queue,
        redis_pool=arq_pool(settings.cell_config),  # msgpack jobs, the full URL (TLS, ACL user)
        job_serializer=pack_arq,
        job_deserializer=unpack_arq,
        on_startup=_startup,
        on_shutdown=_shutdown,
        ctx={"settings": settings, "metrics": metrics or FleetMetrics()},
        handle_signals=handle_signals,
        poll_delay=0.1,
        keep_result=60,
    )


def run_supervisor(settings: SupervisorSettings) -> None:
    """Run until SIGINT/SIGTERM. arq's loop ends on the first Redis error (a restart, a network
    cut): start it again after a pause instead of exiting, so the cell keeps its trimming."""
    stop = asyncio.Event()
    metrics = FleetMetrics()  # one registry for the process: counters survive arq restarts
    server = serve_metrics(settings.metrics_port, metrics.registry) if settings.metrics_port is not None else None
    log.info("%s", up_line(settings, None if server is None else server.port))
    try:
        _supervise(settings, stop, metrics)
    finally:
        if server is not None:
            server.close()
        log.info("supervisor of %s stopped", _cells_text(settings.cell_config))


def up_line(settings: SupervisorSettings, metrics_port: int | None) -> str:
    """The one INFO line a supervisor logs when it starts: what it looks after, how often, where
    its metrics are (the Redis URL is left out: it may hold a password)."""
    config = settings.cell_config
    runner = "its own schedule (Redis Cluster: no arq)" if is_cluster_url(config.redis_url) else "arq"
    metrics = f"metrics on port {metrics_port}" if metrics_port is not None else "no metrics port"
    return (f"supervisor of {_cells_text(config)} up: reap every {settings.interval_s} s, trim every "
            f"{TRIM_EVERY_S} s, on {runner}; {metrics}")


def _cells_text(config: CellConfig) -> str:
    return f"every cell of prefix {config.prefix}" if config.any_cell else \
        f"cell {config.cell} of prefix {config.prefix}"


def _supervise(settings: SupervisorSettings, stop: asyncio.Event, metrics: FleetMetrics) -> None:
    if is_cluster_url(settings.cell_config.redis_url):
        asyncio.run(_supervise_cluster(settings, stop, metrics))
        return
    while not stop.is_set():
        worker = build_worker(settings, metrics=metrics)
        worker.on_stop = lambda _sig: stop.set()
        try:
            worker.run()
            return
        except REDIS_ERRORS as exc:
            log.warning("supervisor lost redis (%s); starting again in %.0fs", exc, RESTART_PAUSE_S)
        worker.loop.run_until_complete(_abandon(worker))
        # A signal during the pause still reaches on_stop: the loop runs while we wait.
        worker.loop.run_until_complete(wait_set(stop, RESTART_PAUSE_S))


async def _supervise_cluster(settings: SupervisorSettings, stop: asyncio.Event, metrics: FleetMetrics) -> None:
    """The cron passes without arq, until SIGINT/SIGTERM; replays are run by the replay CLI."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = settings.cell_config
    # One claim per pass and period: in the cell's slot, or the deployment's for a supervisor of every cell.
    claim_key = config.deployment_keys.pass_claim if config.any_cell else config.keys.pass_claim
    ctx: dict[str, Any] = {"settings": settings, "metrics": metrics, "pass_claim": claim_key}
    await _startup(ctx)
    try:
        await run_passes(ctx, [Pass("reap", settings.interval_s, reap_job), Pass("trim", TRIM_EVERY_S, trim_job)],
                         stop)
    finally:
        await _shutdown(ctx)


async def _abandon(worker: ArqWorker) -> None:
    """Close what a worker that died on a Redis error left open."""
    for redis in (worker.ctx.get("fleet_redis"), worker.pool):
        if redis is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await redis.aclose()


async def request_replay(settings: SupervisorSettings, filters: dict[str, Any], *, dry_run: bool = False) -> str:
    """Ask the supervisors to replay dead letters matching ``filters`` (an arq job); returns its id.
    Not on a Redis Cluster (ArqOnClusterError): there ``rollout-fleet replay run`` (or
    :func:`broker.ops.replay.replay`) replays through the cell's scripts directly."""
    if is_cluster_url(settings.cell_config.redis_url):
        raise ArqOnClusterError("replay jobs go through arq, which cannot run on a Redis Cluster: "
                                "use `rollout-fleet replay run` (it replays through the cell's own scripts)")
    pool = arq_pool(settings.cell_config)
    try:
        job = await pool.enqueue_job("replay_dead", filters, dry_run, _queue_name=queue_name(settings.cell_config))
        if job is None:
            raise RuntimeError("replay job was not enqueued")
        return job.job_id
    finally:
        await pool.aclose()
