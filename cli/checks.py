"""Checks of an invocation that need more than one option (argparse checks one at a time)."""

from __future__ import annotations

from cli.args import Invocation
from cli.demo import MODELS
from cli.errors import UsageError


def check_invocation(run: Invocation) -> None:
    """Raise UsageError for a combination of options that cannot work."""
    args = run.args
    heartbeat = getattr(args, "heartbeat_ms", None)
    if heartbeat is not None and heartbeat >= run.cell.lease_ms:
        # A worker that beats once per lease (or slower) is failed over between two beats.
        raise UsageError(f"heartbeat {heartbeat} ms (--heartbeat-ms, $ROLLOUT_FLEET_HEARTBEAT_MS) must be "
                         f"shorter than the lease, {run.cell.lease_ms} ms (--lease-ms, $ROLLOUT_FLEET_LEASE_MS); "
                         "a third of it is usual")
    interval, threshold = getattr(args, "rebalance_interval_s", None), getattr(args, "rebalance_threshold", None)
    if interval is not None and not 0 <= interval < float("inf"):  # NaN fails this too
        raise UsageError(f"--rebalance-interval ($ROLLOUT_FLEET_REBALANCE_INTERVAL_S) {interval:g} must be 0 (off) or "
                         "a positive number of seconds")
    if threshold is not None and not 0 < threshold <= 1:
        raise UsageError(f"--rebalance-threshold ($ROLLOUT_FLEET_REBALANCE_THRESHOLD) {threshold:g} must be a session "
                         "share in (0, 1]")
    snapshot_every = getattr(args, "snapshot_every", None)
    if snapshot_every is not None and snapshot_every < 0:
        raise UsageError(f"--snapshot-every ($ROLLOUT_FLEET_SNAPSHOT_EVERY) {snapshot_every} must be 0 (off) or a "
                         "number of committed steps")
    if args.command in ("worker", "demo") and run.cell.any_cell:
        raise UsageError(f"--cell '*' ($ROLLOUT_FLEET_CELL): a {args.command} joins one cell; give it a name "
                         "(clients and ops commands take '*' for every cell)")
    if args.command == "demo" and args.engine not in MODELS:
        # The demo's trainer knows the model names of the reference and null engines only; a real
        # engine needs its model, weights and GPU options, which a worker takes with --engine-opt.
        raise UsageError(f"--engine {args.engine}: the demo runs the {' and '.join(MODELS)} engines only; "
                         f"start real-engine workers with `rollout-fleet worker --engine {args.engine} "
                         "--engine-opt model=...` (see README, Engines) and drive them with your trainer")
