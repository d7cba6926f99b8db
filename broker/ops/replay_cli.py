"""``rollout-fleet replay list|show|run``: the dead-letter commands, printed for people or as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from broker.ops.replay import DeadJob, ReplayOutcome, list_dead, replay, replay_ids, show
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from broker.redis.scripts import Scripts


def _print_jobs(jobs: list[DeadJob], as_json: bool) -> None:
    if as_json:
        for job in jobs:
            print(json.dumps(job.summary()))
        return
    print(f"{'entry_id':<18} {'session':<34} {'step':>5} {'attempts':>8} reason")
    for job in jobs:
        print(f"{job.entry_id:<18} {job.session_id:<34} {job.step_id!s:>5} {job.attempts:>8} {job.reason}")
    print(f"{len(jobs)} dead-lettered jobs")


def _print_outcomes(outcomes: list[ReplayOutcome], as_json: bool) -> None:
    for o in outcomes:
        if as_json:
            print(json.dumps(o.__dict__))
        else:
            print(f"{o.entry_id:<18} {o.session_id:<34} {o.step_id!s:>5} {o.status:<22} {o.message}")
    if not outcomes and not as_json:
        print("nothing to replay")


async def run_replay_command(config: CellConfig, args: argparse.Namespace) -> int:
    redis = open_redis(config.redis_url)
    scripts = Scripts(redis, config.keys)
    filters: dict[str, Any] = {"session": args.session, "code": args.code, "older_than_s": args.older_than,
                               "newer_than_s": args.newer_than, "limit": args.limit}
    try:
        if args.action == "list":
            _print_jobs(await list_dead(scripts, **filters), args.json)
        elif args.action == "show":
            for entry_id in args.ids:
                job = await show(scripts, entry_id)
                if job is None:
                    print(json.dumps({"entry_id": entry_id, "error": "not found"}))
                    return 1
                print(json.dumps({**job.summary(), "kind": job.kind, "mode": job.mode, "model": job.model,
                                  "reply_to": job.reply_to, "job_id": job.job_id}, indent=2))
        elif args.ids:
            _print_outcomes(await replay_ids(scripts, args.ids, dry_run=args.dry_run), args.json)
        else:
            _print_outcomes(await replay(scripts, await list_dead(scripts, **filters), dry_run=args.dry_run),
                            args.json)
    finally:
        await redis.aclose()
    return 0
