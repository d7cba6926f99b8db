"""A cell's health from Redis alone: workers, their liveness and load, sessions, dead letters.

``status --check`` (:func:`check_report`) judges the report: unhealthy when Redis refuses writes
(a probe write answers OOM, MISCONF, READONLY or NOREPLICAS), when its ``maxmemory-policy`` may
evict fleet keys, when no worker is live, when a live worker's registry entry says
``engine_ready=0``, or when a dead letter arrived within the check window. The window needs no
state of its own: a dead-letter stream id starts with the Redis time (ms) it was written at, so
the newest letter of the last ``window_ms`` is one XREVRANGE ... COUNT 1 down to
``now - window_ms``. Run the check at least once per window (a cron or a probe every minute with
the default five-minute window) and every new dead letter is seen by a few checks in a row.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from broker.redis.aio import resolve
from broker.redis.cells import cells_of
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis, server_time_ms
from broker.redis.keys import INBOX_GROUP, CellKeys
from broker.redis.memory_policy import eviction_policy, eviction_problem
from broker.redis.refusals import Refusal, refusal_of

DEFAULT_CHECK_WINDOW_S = 300.0  # dead letters newer than this fail --check
PROBE_TTL_MS = 1000  # the write probe's key (CellKeys.write_probe) lives this long
REDIS_TIMEOUT_S = 5.0  # every Redis call of a status report waits at most this long


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    heartbeat_age_ms: int
    fields: dict[str, str]
    inbox_length: int
    inbox_pending: int

    def live(self, lease_ms: int) -> bool:
        """Heartbeat younger than the lease, and not stopped."""
        return self.heartbeat_age_ms <= lease_ms and self.fields.get("state") != "stopped"

    def policy_versions(self) -> dict[str, int]:
        """Each model's version (the registry's per-model field; {} from workers without it)."""
        try:
            versions = json.loads(self.fields.get("policy_versions", "{}"))
        except ValueError:
            return {}
        return {str(k): v for k, v in versions.items() if isinstance(v, int)} if isinstance(versions, dict) else {}

    def models_text(self) -> str:
        """``model@version,...`` where the worker publishes per-model versions, else its models."""
        versions = self.policy_versions()
        models = [m for m in self.fields.get("models", "").split(",") if m]
        return ",".join(f"{m}@{versions[m]}" if m in versions else m for m in models)

    def as_json(self, lease_ms: int) -> dict[str, Any]:
        f = self.fields
        return {
            "worker_id": self.worker_id, "state": f.get("state", ""), "live": self.live(lease_ms),
            "heartbeat_age_ms": self.heartbeat_age_ms, "engine": f.get("engine", ""),
            "models": [m for m in f.get("models", "").split(",") if m],
            "load": _int(f.get("load")), "capacity": _int(f.get("capacity")),
            "policy_version": _int(f.get("policy_version")), "policy_versions": self.policy_versions(),
            "weights_error": f.get("weights_error", ""),
            "inbox_length": self.inbox_length, "inbox_pending": self.inbox_pending,
            "idle_closed": _int(f.get("idle_closed")),
            "drain_stuck": _int(f.get("drain_stuck")),
            "registry": dict(f),  # every field the worker publishes (engine_ready, per-model versions...)
        }


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class CellReport:
    workers: list[WorkerInfo] = field(default_factory=list)
    live_sessions: int = 0
    dead_letters: int = 0
    newest_dead_letter_age_ms: int | None = None  # None: no dead letter within the window (window_ms)
    window_ms: int = 0
    write_refusal: str | None = None  # why Redis refuses writes now (a probe write); None: it writes
    eviction: str | None = None  # what is wrong with maxmemory-policy (broker/redis/memory_policy.py)

    def as_json(self, lease_ms: int) -> dict[str, Any]:
        return {"workers": [w.as_json(lease_ms) for w in self.workers],
                "live_workers": sum(w.live(lease_ms) for w in self.workers),
                "sessions": self.live_sessions, "dead_letters": self.dead_letters,
                "newest_dead_letter_age_ms": self.newest_dead_letter_age_ms, "window_s": self.window_ms / 1000.0,
                "lease_ms": lease_ms, "write_refusal": self.write_refusal, "eviction": self.eviction}


async def _worker_info(redis: Redis, config: CellConfig, wid: str, age_ms: int) -> WorkerInfo:
    keys = config.keys
    raw: Any = await resolve(redis.hgetall(keys.worker(wid)))
    fields = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
    inbox = keys.inbox(wid)
    length = await redis.xlen(inbox)
    pending = 0
    if length:
        summary: Any = await redis.xpending(inbox, INBOX_GROUP)
        pending = int(summary.get("pending", 0)) if isinstance(summary, dict) else 0
    return WorkerInfo(wid, age_ms, fields, int(length), pending)


async def cell_status(url: str | None = None, *, prefix: str | None = None, cell: str | None = None,
                      config: CellConfig | None = None,
                      window_s: float = DEFAULT_CHECK_WINDOW_S) -> CellReport:
    """``url``, ``prefix`` and ``cell`` override ``config``'s (default: ``CellConfig()``);
    ``window_s``: the span whose dead letters count as recent."""
    config = (config or CellConfig()).with_overrides(redis_url=url, prefix=prefix, cell=cell)
    keys = config.keys
    # Not decoding: dead letters carry binary payloads (read here, only counted).
    redis = open_redis(config.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        now_ms = await server_time_ms(redis, keys.workers)
        beats: Any = await redis.zrange(keys.workers, 0, -1, withscores=True)
        infos = [await _worker_info(redis, config, wid.decode(), now_ms - int(score)) for wid, score in beats]
        window_ms = int(window_s * 1000)
        # Stream ids start with their write time: the newest letter, if it is within the window
        # (one entry read; letters carry payloads of up to 64 KiB, so none are read in bulk).
        newest: Any = await redis.xrevrange(keys.dead, "+", f"{max(0, now_ms - window_ms)}-0", count=1)
        newest_age = now_ms - int(newest[0][0].split(b"-")[0]) if newest else None
        return CellReport(workers=infos, live_sessions=int(await resolve(redis.hlen(keys.sessions))),
                          dead_letters=int(await resolve(redis.xlen(keys.dead))), newest_dead_letter_age_ms=newest_age,
                          window_ms=window_ms, write_refusal=await write_refusal(redis, keys),
                          eviction=eviction_problem(await eviction_policy(redis)))
    finally:
        await redis.aclose()


async def fleet_status(config: CellConfig, *, window_s: float = DEFAULT_CHECK_WINDOW_S) -> dict[str, CellReport]:
    """The report of ``config``'s cell, or with cell ``*`` of every known cell (by name)."""
    if not config.any_cell:
        return {config.cell: await cell_status(config=config, window_s=window_s)}
    redis = open_redis(config.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        cells = await cells_of(redis, config)
    finally:
        await redis.aclose()
    return {cell: await cell_status(config=config.in_cell(cell), window_s=window_s) for cell in cells}


async def write_refusal(redis: Redis, keys: CellKeys) -> str | None:
    """Why Redis refuses writes in the cell's slot now: a probe write (a 1 s key), its refusal
    (OOM with the memory figures, MISCONF, READONLY, NOREPLICAS) said in one line; None when it
    writes, or when the ACL does not let this client write (then nothing is known)."""
    try:
        await redis.set(keys.write_probe, b"1", px=PROBE_TTL_MS)
    except NoPermissionError:
        return None
    except ResponseError as exc:
        reason = refusal_of(exc)
        if reason is None:
            raise
        return f"{reason.value}: {exc}{await _memory_figures(redis) if reason is Refusal.OOM else ''}"
    return None


async def _memory_figures(redis: Redis) -> str:
    try:
        info: Any = await redis.info("memory")
    except (RedisError, OSError):
        return ""
    return f" (used_memory {info.get('used_memory_human', '?')} of maxmemory {info.get('maxmemory_human', '?')})"


def check_report(report: CellReport, lease_ms: int) -> tuple[bool, str]:
    """(healthy, one line saying why) for ``status --check``."""
    if report.write_refusal is not None:
        return False, f"redis refuses writes ({report.write_refusal}); see docs/faults.md"
    if report.eviction is not None:
        return False, report.eviction
    live = [w for w in report.workers if w.live(lease_ms)]
    if not live:
        return False, f"no live worker ({len(report.workers)} registered, lease {lease_ms} ms)"
    not_ready = [f"{w.worker_id} ({w.fields.get('engine_reason', '')})" for w in live
                 if w.fields.get("engine_ready") == "0"]
    if not_ready:
        return False, f"engine not ready on {len(not_ready)} live worker(s): {', '.join(not_ready)}"
    if report.newest_dead_letter_age_ms is not None:
        return False, (f"dead letter(s) within the last {report.window_ms / 1000:g} s, the newest "
                       f"{report.newest_dead_letter_age_ms / 1000:.1f} s ago ({report.dead_letters} kept; "
                       "see 'rollout-fleet replay list')")
    return True, (f"ok: {len(live)} live worker(s), {report.live_sessions} session(s), no dead letter in the "
                  f"last {report.window_ms / 1000:g} s")


def format_status(report: CellReport, lease_ms: int | None = None) -> str:
    """A table of the report; a worker is live (``live`` in ``--json`` too) while its heartbeat is
    younger than ``lease_ms`` (default: the cell's default lease). A worker's last weights error
    follows on its own line."""
    lease_ms = CellConfig().lease_ms if lease_ms is None else lease_ms
    lines = [f"{'worker':<40} {'state':<9} {'live':<6} {'beat_ms':>8} {'load':>5} {'inbox':>6} {'pending':>7} "
             f"{'idle_closed':>11} {'engine':<10} {'version':>7} {'models@version':<40} engine_ready"]
    for w in report.workers:
        f = w.fields
        live = "yes" if w.live(lease_ms) else "NO"
        lines.append(f"{w.worker_id:<40} {f.get('state', '?'):<9} {live:<6} {w.heartbeat_age_ms:>8} "
                     f"{f.get('load', '?'):>5} {w.inbox_length:>6} {w.inbox_pending:>7} "
                     f"{f.get('idle_closed', '0'):>11} {f.get('engine', '?'):<10} "
                     f"{f.get('policy_version', '?'):>7} {w.models_text():<40} {_engine_ready(f)}")
        if f.get("weights_error"):
            lines.append(f"  weights error: {f['weights_error']}")
        if f.get("drain_stuck", "0") not in ("", "0"):
            lines.append(f"  draining: {f['drain_stuck']} sessions found no live worker with free capacity; "
                         "serving them until one has room or the drain timeout passes")
    lines.append(f"sessions={report.live_sessions} dead_letters={report.dead_letters} "
                 f"checked_at={time.strftime('%H:%M:%S')}")
    lines += [f"redis refuses writes: {report.write_refusal}"] if report.write_refusal else []
    lines += [report.eviction] if report.eviction else []
    return "\n".join(lines)


def _engine_ready(fields: dict[str, str]) -> str:
    """yes, or NO with the worker's reason (a worker from before readiness checks says nothing: ?)."""
    ready = fields.get("engine_ready")
    if ready is None:
        return "?"
    return "yes" if ready == "1" else f"NO ({fields.get('engine_reason', '')})"
