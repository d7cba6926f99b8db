"""Worker configuration: one frozen dataclass, built at the edge (CLI) and passed down."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.redis.config import CellConfig
from broker.redis.durability import DURABILITY_MODES, Durability, ReplicaWait
from broker.redis.layouts import ReplyBounds
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.results_wire import WILDCARD_HOSTS, parse_address, parse_host_or_address


def new_worker_id() -> str:
    """A fresh id per process start: a restarted worker is a new incarnation."""
    return f"w-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerSettings:
    cell_config: CellConfig = field(default_factory=CellConfig)  # Redis URL, prefix, cell, lease
    worker_id: str = field(default_factory=new_worker_id)
    capacity: int = 256  # sessions this worker may own
    heartbeat_ms: int = 1000
    read_count: int = 256  # entries per XREADGROUP
    # How long an inbox or control-stream read waits for an entry. Redis answers a blocked read the
    # moment an entry arrives, so this sets no latency, only how often an idle worker asks again
    # (15 s: two reads, inbox and control stream, per 15 s); a stop or a re-registration cancels the
    # read at once.
    block_ms: int = 15_000
    max_inflight: int = 4096  # jobs read but not finished (backpressure on the reader)
    # How often the reader reads its own pending entries again (from the start of its inbox): an
    # entry Redis delivered to this worker whose reply never reached it (a connection that failed
    # after the delivery), or a job a Redis error ended here before its commit, runs then instead of
    # waiting for ever. At most one extra read per interval, and only between blocked reads.
    pending_check_s: float = 30.0
    batch_wait_ms: float = 0.0  # extra wait to fill a batch; 0 takes what is queued now
    max_attempts: int = 3  # engine attempts per step for transient errors
    retry_backoff_ms: float = 50.0
    reply_ttl_ms: int = 3_600_000
    reply_stream_bytes: int = 256 * 1024 * 1024  # a reply stream's byte budget (broker ReplyBounds)
    large_reply_bytes: int = 1024 * 1024  # a result this large gives its reply stream ...
    large_reply_ttl_ms: int = 600_000  # ... this shorter TTL
    close_grace_ms: int = 60_000  # a closed session's stored results are kept this long
    # A closed session's hash (committed step, context length, closed) is kept this long, so status
    # and a second close answer as the serving layer's do (it keeps closed sessions) for a span a
    # trainer can rely on; the hash is small, its stored results go after close_grace_ms.
    closed_retention_hours: float = 24.0
    drain_timeout_s: float = 30.0
    idle_sweep_s: float = 5.0  # how often the worker closes its sessions idle past their timeout
    version_wait_s: float = 300.0  # the longest a step waits at the weight gate for its min_policy_version
    handover_on_stop: bool = True  # on SIGTERM hand sessions to live workers (no lease wait)
    metrics_port: int | None = None  # serve /metrics here (0: a free port); None: no metrics server
    reap: bool = True  # take part in failing over dead workers (workers/reaper.py), no supervisor needed
    rebalance_interval_s: float = 5.0  # how often to check for imbalance (workers/rebalance.py); 0: never
    rebalance_threshold: float = 0.25  # move sessions while our session share exceeds a target's by more
    # "async": a step's reply goes out with its commit (Redis replicates afterwards); "replicated":
    # only once durability_replicas replicas have the commit (broker/redis/durability.py), waiting
    # up to durability_timeout_s before the step answers `timeout` instead of "committed".
    durability: Durability = Durability.ASYNC
    durability_replicas: int = 1
    durability_timeout_s: float = 30.0
    snapshot_every: int = 16  # snapshot a session's engine context every N committed steps; 0: never
    # Hand large committed results to trainers directly (workers/result_server.py, schemas/results_wire.py):
    # listen at serve_results (HOST:PORT, port 0: a free one; None: off), advertised as
    # results_advertise (HOST:PORT, or HOST alone: with the port it listens on; default: the
    # address it listens on); each result kept results_hold_s for its trainer,
    # at most results_max_bytes in all. Only with durability async.
    serve_results: str | None = None
    results_advertise: str | None = None
    results_hold_s: float = 5.0
    results_max_bytes: int = 256 * 1024 * 1024
    limits: Limits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        for name in ("capacity", "heartbeat_ms", "read_count", "max_inflight", "max_attempts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        self.reply_bounds()  # validated here, at the edge
        if (self.version_wait_s <= 0 or self.idle_sweep_s <= 0 or self.pending_check_s <= 0
                or not 0 < self.closed_retention_hours < 1e6):
            raise ValueError("version_wait_s, idle_sweep_s, pending_check_s and closed_retention_hours must be "
                             "positive (and closed_retention_hours under 1e6)")
        if self.rebalance_interval_s < 0 or not 0 < self.rebalance_threshold <= 1:
            raise ValueError("rebalance_interval_s must be >= 0 (0: off) and rebalance_threshold in (0, 1]")
        if self.cell_config.any_cell:
            raise ValueError("a worker joins one cell: give it a cell name (--cell NAME), not '*'")
        if self.durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}")
        object.__setattr__(self, "durability", Durability(self.durability))  # from a flag: the enum
        if self.durability_replicas < 1 or self.durability_timeout_s <= 0:
            raise ValueError("durability_replicas and durability_timeout_s must be positive")
        if self.snapshot_every < 0:
            raise ValueError("snapshot_every must be >= 0 (0: no snapshots)")
        if self.heartbeat_ms >= self.cell_config.lease_ms:
            raise ValueError("heartbeat_ms must be shorter than lease_ms")
        self._check_result_serving()

    def _check_result_serving(self) -> None:
        if self.results_hold_s <= 0 or self.results_max_bytes <= 0:
            raise ValueError("results_hold_s and results_max_bytes must be positive")
        if self.serve_results is None:
            if self.results_advertise is not None:
                raise ValueError("results_advertise needs serve_results (--serve-results HOST:PORT)")
            return
        try:
            listen_host = parse_address(self.serve_results)[0]
        except ValueError as exc:
            raise ValueError(f"serve_results: {exc}") from None
        if self.results_advertise is not None:
            try:
                advertise_host = parse_host_or_address(self.results_advertise)[0]
            except ValueError as exc:
                raise ValueError(f"results_advertise: {exc}") from None
            if advertise_host in WILDCARD_HOSTS:
                raise ValueError(f"results_advertise {self.results_advertise}: trainers cannot reach a wildcard "
                                 "address; give this worker's own address")
        elif listen_host in WILDCARD_HOSTS:
            raise ValueError(f"serve_results {self.serve_results} listens on every address: give results_advertise "
                             "(--results-advertise HOST or HOST:PORT), the address trainers reach this worker at")
        if self.durability is Durability.REPLICATED:
            raise ValueError("serve_results needs durability async: with replicated durability a result is "
                             "published once a replica has it, and its trainer reads it from Redis")

    def replica_wait(self) -> ReplicaWait | None:
        """What a commit waits for before its reply goes out; None: nothing (durability async)."""
        return ReplicaWait(self.durability_replicas) if self.durability is Durability.REPLICATED else None

    def reply_bounds(self) -> ReplyBounds:
        return ReplyBounds(self.reply_stream_bytes, self.large_reply_bytes, self.large_reply_ttl_ms)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> WorkerSettings:
        """Build from a flat mapping: the cell's settings (``redis_url``, ``prefix``, ``cell``,
        ``lease_ms``) beside the worker's own. Unknown keys are an error, not silently ignored;
        a value of None means the default."""
        cell_names = {f.name for f in dataclasses.fields(CellConfig)}
        known = cell_names | {f.name for f in dataclasses.fields(cls)} - {"cell_config"}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown worker settings: {', '.join(sorted(unknown))}")
        given = {k: v for k, v in values.items() if v is not None}
        cell = CellConfig(**{k: v for k, v in given.items() if k in cell_names})
        return cls(cell_config=cell, **{k: v for k, v in given.items() if k not in cell_names})
