"""``rollout-fleet status [--json] [--watch [SECONDS]] [--check [--window SECONDS]]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from types import FrameType

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


class _Interrupt:
    """Ctrl-C while watching: remembered, and it stops what runs now. A report under way is
    cancelled, as ``asyncio.run`` would; the flag ends the watch even when the cancellation is
    swallowed on the way (on Python 3.11+ one that lands in redis-py's connection check,
    ``asyncio.timeout(0)``, is: CPython issue 134471), which left the watch drawing. The sleep
    between frames is interrupted at once."""

    def __init__(self) -> None:
        self.seen = False
        self.sleeping = False
        self.report: asyncio.Task[Reports] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        report = self.report
        if report is not None and not report.done():
            report.cancel()
            report.get_loop().call_soon_threadsafe(lambda: None)  # wake a loop blocked in select()
        elif self.sleeping:
            raise KeyboardInterrupt

    def run_report(self, config: CellConfig, window_s: float) -> Reports | None:
        """The report, or None when interrupted meanwhile."""
        with asyncio.Runner() as runner:
            self.report = runner.get_loop().create_task(fleet_status(config, window_s=window_s))
            try:
                reports = runner.get_loop().run_until_complete(self.report)
            except asyncio.CancelledError:
                return None
            finally:
                self.report = None
        return None if self.seen else reports

    def sleep(self, seconds: float) -> None:
        self.sleeping = True
        try:
            if not self.seen:
                time.sleep(seconds)
        finally:
            self.sleeping = False


def _watch(config: CellConfig, args: argparse.Namespace) -> int:
    """Redraw every ``args.watch`` seconds until Ctrl-C; a Redis error is shown, not fatal."""
    tty = sys.stdout.isatty()
    interrupt = _Interrupt()
    previous = signal.signal(signal.SIGINT, interrupt)  # asyncio then leaves SIGINT to it
    try:
        while not interrupt.seen:
            try:
                reports = interrupt.run_report(config, args.window)
                if reports is None:
                    break
                text = _render(reports, config, args.json)
            except (RedisError, OSError) as exc:  # the URL is not printed: it may hold a password
                text = f"status: Redis did not answer: {exc}"
            if interrupt.seen:
                break
            print((CLEAR if tty and not args.json else "") + text, flush=True)
            interrupt.sleep(args.watch)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)
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
