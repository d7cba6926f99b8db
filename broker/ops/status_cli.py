"""``rollout-fleet status [--json] [--watch [SECONDS]] [--check [--window SECONDS]]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from redis.exceptions import RedisError

from broker.ops.status import CellReport, cell_status, check_report, format_status
from broker.redis.config import CellConfig

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a watched table redraws in place on a terminal


def _report(config: CellConfig, window_s: float) -> CellReport:
    return asyncio.run(cell_status(config=config, window_s=window_s))


def _render(report: CellReport, config: CellConfig, as_json: bool) -> str:
    if as_json:
        return json.dumps(report.as_json(config.lease_ms), sort_keys=True)
    return format_status(report, lease_ms=config.lease_ms)


def _watch(config: CellConfig, args: argparse.Namespace) -> int:
    """Redraw every ``args.watch`` seconds until Ctrl-C; a Redis error is shown, not fatal."""
    tty = sys.stdout.isatty()
    try:
        while True:
            try:
                text = _render(_report(config, args.window), config, args.json)
            except (RedisError, OSError) as exc:  # the URL is not printed: it may hold a password
                text = f"status: Redis did not answer: {exc}"
            print((CLEAR if tty and not args.json else "") + text, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def run_status_command(config: CellConfig, args: argparse.Namespace) -> int:
    """0 when shown (or healthy with --check); 1 when --check finds a problem. A Redis error goes
    up to the CLI, which says it in one line (the password left out) with exit 2."""
    if args.watch is not None:
        return _watch(config, args)
    report = _report(config, args.window)
    if args.check:
        healthy, why = check_report(report, config.lease_ms)
        print(why if healthy else f"unhealthy: {why}")
        return 0 if healthy else 1
    print(_render(report, config, args.json))
    return 0
