"""``rollout-fleet replay list|show|run``: the dead-letter commands, printed for people or as JSON.

A field a dead letter lacks prints as ``-`` (``null`` in JSON); ``show`` of an id no cell holds,
like ``sessions show`` of an unknown session, is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from broker.ops.replay import DeadJob, ReplayOutcome, list_dead, replay, replay_ids, show
from broker.redis.cells import cells_of
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts
from cli.env import filters_from_env

ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")  # a stream entry id (ms, or ms-seq)
# list, and run without ids: the filters, which say so when they come from the environment.
FILTERS = {"session": "--session", "code": "--code", "older_than": "--older-than", "newer_than": "--newer-than",
           "limit": "--limit"}


def _shown(value: object) -> str:
    """A field for people: ``-`` when it is missing (never Python's ``None``)."""
    return "-" if value is None or value == "" else str(value)


def _print_jobs(jobs: list[DeadJob], as_json: bool) -> None:
    if as_json:
        for job in jobs:
            print(json.dumps(job.summary()))
        return
    print(f"{'entry_id':<18} {'session':<34} {'step':>5} {'attempts':>8} reason")
    for job in jobs:
        print(f"{job.entry_id:<18} {_shown(job.session_id):<34} {_shown(job.step_id):>5} {job.attempts:>8} "
              f"{_shown(job.reason)}")
    print(f"{len(jobs)} dead-lettered jobs")


def _print_outcomes(outcomes: list[ReplayOutcome], as_json: bool) -> None:
    for o in outcomes:
        if as_json:
            print(json.dumps(o.__dict__))
        else:
            print(f"{o.entry_id:<18} {_shown(o.session_id):<34} {_shown(o.step_id):>5} {o.status:<22} {o.message}")
    if not outcomes and not as_json:
        print("nothing to replay")


async def _find(cells: list[Scripts], entry_id: str) -> tuple[Scripts, DeadJob | None]:
    """The cell whose dead-letter stream holds ``entry_id`` (stream ids are per cell), with its job;
    the first cell and None when none holds it."""
    for scripts in cells:
        job = await show(scripts, entry_id)
        if job is not None:
            return scripts, job
    return cells[0], None


async def _run(cells: list[Scripts], args: argparse.Namespace, filters: dict[str, Any]) -> int:
    if args.action == "list":
        jobs: list[DeadJob] = []
        for scripts in cells:
            jobs += await list_dead(scripts, **filters)
        _print_jobs(jobs, args.json)
    elif args.action == "show":
        for entry_id in args.ids:
            _, job = await _find(cells, entry_id)
            if job is None:
                print(f"replay show: not_found: dead letter {entry_id!r} is in no cell's dead-letter stream "
                      "(already replayed, trimmed or removed)", file=sys.stderr)
                return 2
            print(json.dumps({**job.summary(), "kind": job.kind, "mode": job.mode, "model": job.model,
                              "reply_to": job.reply_to, "job_id": job.job_id}, indent=2))
    elif args.ids:
        outcomes: list[ReplayOutcome] = []
        for entry_id in args.ids:
            scripts, _ = await _find(cells, entry_id)
            outcomes += await replay_ids(scripts, [entry_id], dry_run=args.dry_run)
        _print_outcomes(outcomes, args.json)
    else:
        outcomes = []
        for scripts in cells:
            outcomes += await replay(scripts, await list_dead(scripts, **filters), dry_run=args.dry_run)
        _print_outcomes(outcomes, args.json)
    return 0


async def run_replay_command(config: CellConfig, args: argparse.Namespace) -> int:
    """The dead letters of one cell, or with --cell '*' of every known cell (``--limit`` counts per
    cell; an entry id is looked for in every cell)."""
    if args.action == "show" and not args.ids:
        print("replay show: an ENTRY_ID is required", file=sys.stderr)
        return 2
    bad = [entry_id for entry_id in args.ids if not ENTRY_ID.fullmatch(entry_id)]
    if bad:
        print(f"replay {args.action}: invalid_request: not a dead-letter entry id: {bad[0][:64]!r}", file=sys.stderr)
        return 2
    redis = open_redis(config.redis_url)
    filters: dict[str, Any] = {"session": args.session, "code": args.code, "older_than_s": args.older_than,
                               "newer_than_s": args.newer_than, "limit": args.limit}
    try:
        cells = [Scripts(redis, CellKeys(config.prefix, cell)) for cell in await cells_of(redis, config)]
        if not cells:
            print("no cell has registered a worker")
            return 0
        code = await _run(cells, args, filters)
    finally:
        await redis.aclose()
    said = filters_from_env(args, FILTERS) if args.action == "list" or not args.ids else None
    if said:  # after the list, where its count is read
        print(f"replay {args.action}: {said}", file=sys.stderr)
    return code
