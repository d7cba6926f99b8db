"""``rollout-fleet sessions list|show|close``: printed for people or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from broker.ops.sessions import SessionDetail, SessionRow, close_session, list_sessions, show_session
from broker.redis.cells import cells_of, routed_cell
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from cli.env import filters_from_env
from schemas.errors import FleetError

REDIS_TIMEOUT_S = 5.0  # every Redis call of these commands waits at most this long
# list's filters: one taken from the environment says so on stderr ($ROLLOUT_FLEET_MODEL, say,
# exported for the gateway, would otherwise hide the other models' sessions without a word).
FILTERS = {"model": "--model", "owner": "--owner", "state": "--state", "limit": "--limit"}


def _print_rows(rows: list[SessionRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row.as_json()))
        return
    print(f"{'session':<34} {'state':<8} {'model':<16} {'owner':<28} {'epoch':>5} {'committed':>9} {'idle_s':>8} "
          f"{'priority':<11} trainer")
    for r in rows:
        print(f"{r.session_id:<34} {r.state:<8} {r.model:<16} {r.owner:<28} {r.epoch:>5} "
              f"{r.committed_step_id:>9} {r.idle_ms / 1000:>8.1f} {r.priority:<11} {r.trainer or '-'}")
    print(f"{len(rows)} sessions")


def _span(span: tuple[int, int] | None) -> str:
    return "none" if span is None else f"{span[0]}..{span[1]}"


def _print_detail(d: SessionDetail, as_json: bool) -> None:
    if as_json:
        print(json.dumps(d.as_json()))
        return
    timeout = f"{d.idle_timeout_ms / 1000:g} s" if d.idle_timeout_ms else "never"
    print(f"session {d.session_id}: {d.state}{' (idle timeout)' if d.idle_closed else ''}\n"
          f"  mode {d.mode}, model {d.model}, priority {d.priority}, trainer {d.trainer or '-'}\n"
          f"  owner {d.owner}, epoch {d.epoch}\n"
          f"  steps: committed {d.committed_step_id}, next {d.next_step_id}, generation {d.gen}, "
          f"context length {d.context_length}\n"
          f"  stored results {_span(d.results)} (window {d.result_window}), "
          f"step records {_span(d.inputs)} (retention {d.retention})\n"
          f"  policy version {'-' if d.policy_version is None else d.policy_version} (last committed step)\n"
          f"  idle {d.idle_ms / 1000:.1f} s (closes after {timeout} idle)")


async def _run(config: CellConfig, args: argparse.Namespace) -> int:
    """One cell's sessions, or with --cell '*' every known cell's (show and close: the cell the id
    names)."""
    if args.action == "close":
        _print_detail(await close_session(config.in_cell(routed_cell(config, args.session_id)), args.session_id),
                      args.json)
        return 0
    redis = open_redis(config.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        if args.action == "list":
            rows: list[SessionRow] = []
            for cell in await cells_of(redis, config):
                rows += await list_sessions(redis, config.in_cell(cell).keys, model=args.model, owner=args.owner,
                                            state=args.state, limit=args.limit - len(rows))
                if len(rows) >= args.limit:
                    break
            _print_rows(rows, args.json)
            said = filters_from_env(args, FILTERS)  # after the list, where its count is read
            if said:
                print(f"sessions list: {said}", file=sys.stderr)
        else:
            keys = config.in_cell(routed_cell(config, args.session_id)).keys
            _print_detail(await show_session(redis, keys, args.session_id), args.json)
        return 0
    finally:
        await redis.aclose()


async def run_sessions_command(config: CellConfig, args: argparse.Namespace) -> int:
    """0 on success; 2 (one line on stderr) for an unknown or invalid session. A Redis error goes
    up to the CLI, which says it in one line (the password left out) with exit 2."""
    if args.action in ("show", "close") and not args.session_id:
        print(f"sessions {args.action}: a SESSION_ID is required", file=sys.stderr)
        return 2
    try:
        return await _run(config, args)
    except FleetError as exc:  # session_not_found, invalid_request (a malformed id)
        print(f"sessions {args.action}: {exc}", file=sys.stderr)
    except ValueError as exc:  # a session hash without the layout broker/redis/layouts.py owns
        print(f"sessions {args.action}: unreadable session: {exc}", file=sys.stderr)
    return 2
