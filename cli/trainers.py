"""``rollout-fleet trainers list|set-cap|remove-cap|set-default-cap|remove-default-cap``: per-trainer
caps on open sessions (what a cap means: :mod:`broker.ops.trainers`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from broker.ops.trainers import TrainerRow, list_trainers, set_cap
from broker.redis.cells import cells_of
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from schemas.errors import InvalidRequestError
from schemas.sharing import DEFAULT_CAP_FIELD, MAX_CAP, as_cap, as_trainer

REDIS_TIMEOUT_S = 5.0  # every Redis call of these commands waits at most this long

# action -> (takes a NAME, takes a CAP); list takes neither.
_ACTIONS = {"list": (False, False), "set-cap": (True, True), "remove-cap": (True, False),
            "set-default-cap": (False, True), "remove-default-cap": (False, False)}
_USAGE = {"list": "list", "set-cap": "set-cap NAME CAP", "remove-cap": "remove-cap NAME",
          "set-default-cap": "set-default-cap CAP", "remove-default-cap": "remove-default-cap"}


def _change(action: str, values: list[str]) -> tuple[str, int | None]:
    """The caps hash field the command changes and the cap it sets (None: remove it), checked
    before anything is touched."""
    named, capped = _ACTIONS[action]
    if len(values) != named + capped:
        raise InvalidRequestError(f"expected: trainers {_USAGE[action]}")
    field = as_trainer(values[0]) if named else DEFAULT_CAP_FIELD
    if not capped:
        return field, None
    raw = values[-1]
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10:
        raise InvalidRequestError(f"a trainer cap must be an integer in [0, {MAX_CAP}], got {raw!r:.100}")
    return field, as_cap(int(raw))


def _print_rows(rows: list[TrainerRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return
    print(f"{'cell':<10} {'trainer':<40} {'open':>6} {'cap':>8}")
    for r in rows:
        cap = "-" if r.cap is None else f"{r.cap}{'' if r.own_cap else ' (*)'}"
        print(f"{r.cell:<10} {r.trainer:<40} {r.open_sessions:>6} {cap:>8}")
    print(f"{len(rows)} rows (cap '-': none; '(*)': the default cap)")


async def _run(config: CellConfig, args: argparse.Namespace) -> int:
    field, cap = _change(args.action, list(args.values))
    redis = open_redis(config.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        cells = await cells_of(redis, config)
        if args.action == "list":
            rows: list[TrainerRow] = []
            for cell in cells:
                rows += await list_trainers(redis, config.in_cell(cell).keys, cell)
            _print_rows(rows, args.json)
            return 0
        for cell in cells:
            await set_cap(redis, config.in_cell(cell).keys, field, cap)
        what = "the default cap" if field == DEFAULT_CAP_FIELD else f"trainer {field}'s cap"
        print(f"{what}: {'removed' if cap is None else cap} in cell{'s' if len(cells) != 1 else ''} "
              f"{', '.join(cells) or '(none known)'}")
        return 0
    finally:
        await redis.aclose()


async def run_trainers_command(config: CellConfig, args: argparse.Namespace) -> int:
    """0 on success; 2 (one line on stderr, nothing changed) for a bad name or cap. A Redis error
    goes up to the CLI, which says it in one line with exit 2."""
    try:
        return await _run(config, args)
    except InvalidRequestError as exc:
        print(f"trainers {args.action}: {exc.message}", file=sys.stderr)
        return 2
