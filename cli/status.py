"""``rollout-fleet status [--json] [--watch [SECONDS]] [--check [--window SECONDS]]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from redis.exceptions import RedisError

from broker.ops.status import CellReport, check_report, fleet_status, format_status
from broker.redis.config import CellConfig

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a watched table redraws in place on a terminal


Reports = dict[str, CellReport]  # cell -> its report: one cell, or every cell with --cell '*'


def _report(config: CellConfig, window_s: float) -> Reports:
    return asyncio.run(fleet_status(config, window_s=window_s))


def _render(reports: Reports, config: CellConfig, as_json: bool) -> str:
    """One cell as it always was; every cell (--cell '*') as one section (JSON: one key) per cell."""
    if not config.any_cell:
        (report,) = reports.values()
        return json.dumps(report.as_json(config.lease_ms), sort_keys=True) if as_json else \
            format_status(report, lease_ms=config.lease_ms)
    if as_json:
        cells = {cell: report.as_json(config.lease_ms) for cell, report in reports.items()}
        return json.dumps({"cells": cells}, sort_keys=True)
    if not reports:
        return "no cell has registered a worker"
    return "\n\n".join(f"cell {cell}:\n{format_status(r, lease_ms=config.lease_ms)}" for cell, r in reports.items())


def _check(reports: Reports, config: CellConfig) -> tuple[bool, str]:
    """Healthy when every cell is; with several cells, each cell's line is named."""
    if not reports:
        return False, "no cell has registered a worker"
    if not config.any_cell:
        (report,) = reports.values()
        return check_report(report, config.lease_ms)
    verdicts = {cell: check_report(report, config.lease_ms) for cell, report in reports.items()}
    bad = [f"cell {cell}: {why}" for cell, (healthy, why) in verdicts.items() if not healthy]
    if bad:
        return False, "; ".join(bad)
    return True, "; ".join(f"cell {cell}: {why}" for cell, (_, why) in verdicts.items())


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
        healthy, why = _check(report, config)
        print(why if healthy else f"unhealthy: {why}")
        return 0 if healthy else 1
    print(_render(report, config, args.json))
    return 0
