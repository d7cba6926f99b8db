"""What a token step's two scripts cost a master: this checkout's Lua against a revision's.

    python -m bench.step_scripts --size full --baseline 583cbfa

The master's main thread is the one resource that does not scale inside a cell (docs/sizing.md),
and most of a token step's share of it is the enqueue and commit scripts. This runs both the way a
trainer and a worker call them (``Scripts.enqueue`` and ``Scripts.commit``, a batch of calls made
in one event-loop turn leaving as one script call) on two private Redis servers side by side: one
runs this checkout's ``enqueue.lua`` and ``commit.lua``, the other the revision's, through this
checkout's calls (so the revision's scripts must take the same KEYS and ARGV); each side's sessions
are made by its own ``create.lua`` (which decides the session hash's encoding). Rounds alternate
between the two in short chunks, so a VM that slows down slows both.

Each round: a batch of enqueues (one step of each of ``batch`` sessions), the worker's read of
them, their commits, and a trim of the reply stream (standing in for the trainer's read). Rows per
side: the scripts' time per step (INFO commandstats, ``EVALSHA`` with the commands it calls) and
the master's main-thread CPU per step (the reads, the trims and the I/O included); then the ratio.
Redis's own accounting is timed, so compare the two sides of one run, not runs.

``--callgrind`` runs both servers under valgrind's callgrind instead and counts the instructions
each runs for the measured rounds: the same count for the same work on any VM, however busy, so a
change of a few percent shows (a timed run swings by up to 2x). Rows per side: instructions per
step in all, in the scripts (``evalShaCommand`` with what it calls), in the commands the scripts
call (``scriptCall``), the scripts' own work (the difference: the Lua interpreter, the conversion of
arguments and replies) and outside the scripts (reading requests, writing replies, the worker's
read, the trims). Needs valgrind (``callgrind_control``, ``callgrind_annotate``); ~2 minutes at
``--size full``.

``--xadd-enqueue`` measures the floor of the lead in docs/sizing.md (an owner that checks a step
when it reads it, the enqueue becoming one ``XADD`` to its inbox) instead of a revision: the other
side runs this checkout's scripts too, but enqueues each step as one ``XADD`` of the entry's fields
``enqueue.lua`` writes for it (sent in one pipeline per batch), nothing read, checked or written
besides. Whatever such an owner would have to add (its checks, the session's idle timer, the
refusal of a stale client's entry) comes on top of that floor. Since 2026-12-08 that entry is the
packed one (six fields; thirteen before). ``--xadd-enqueue packed`` writes three fields instead:
``session_id``, every other small field joined into one (``m``, NUL-separated) and ``payload``;
the round's read takes them apart again. Each field is two bulk strings in the worker's read,
which Redis writes one by one.

    python -m bench.step_scripts --size full --xadd-enqueue
    python -m bench.step_scripts --size full --xadd-enqueue packed --callgrind
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis

from bench.common import Callgrind, Row, format_table, private_redis
from broker.redis.connect import open_redis
from broker.redis.embedded import RedisServer
from broker.redis.inbox import InboxEntry
from broker.redis.keys import INBOX_GROUP, CellKeys
from broker.redis.layouts import PACKED, PACKED_PARTS, READS_FIELD, READS_PACKED
from broker.redis.lua_files import PRELUDE_MARK, prelude_for
from broker.redis.script_replies import Committed, Created, Queued
from broker.redis.scripts import CommitCall, Scripts

NAME = "step_scripts"
# Inclusive instruction counts read from a server's profile: the scripts, and the commands they call.
FUNCTIONS = {"scripts": "evalShaCommand", "commands_in_scripts": "scriptCall"}
REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("create", "enqueue", "commit")  # the sessions made, and the step's two scripts
MODE, MODEL = "tokens", "null-lm"
WORKER = "w-step-scripts"
REPLY_TO = "t-step-scripts"
PAYLOAD = b"\x85" * 120  # a 16-token step's encoded input
RESULT = b"\x86" * 160  # its result: tokens and log probs
RECORD = b"\x87" * 200  # the step record a new owner replays


@dataclass(frozen=True)
class Size:
    sessions: int
    chunks: int  # per side, alternated
    rounds: int  # per chunk


SIZE = {"smoke": Size(sessions=64, chunks=2, rounds=4), "full": Size(sessions=512, chunks=40, rounds=25)}


def revision_sources(revision: str) -> dict[str, str]:
    """The revision's :data:`SCRIPTS` as Redis runs them at that revision: the prelude prepended
    whole, or only the part each script names from the revision that began to do so (161ae7e,
    ``prelude_for`` in its broker/redis/lua_files.py) on."""
    def show(path: str, *, required: bool = True) -> str:
        done = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{path}"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0 and required:
            raise SystemExit(f"cannot read {Path(path).name} at {revision!r}: {done.stderr.strip()}")
        return done.stdout

    prelude = show("broker/redis/lua/prelude.lua")
    trims = "def prelude_for" in show("broker/redis/lua_files.py", required=False)  # absent before it

    def composed(source: str) -> str:
        if PRELUDE_MARK not in source:
            return source
        return (prelude_for(source, prelude) if trims else prelude) + source

    return {name: composed(show(f"broker/redis/lua/{name}.lua")) for name in SCRIPTS}


def _pid(server: RedisServer) -> int:
    if server.process is None:
        raise RuntimeError("the private Redis is not running")
    return server.process.pid


COLLECT_LUA_GARBAGE = "collectgarbage('collect') return 0"
XADD_SIDES = {"full": "xadd enqueue", "packed": "xadd enqueue, packed entry"}  # the other side, by --xadd-enqueue


class Side:
    """One private Redis with one worker, ``sessions`` token sessions and one version of the scripts;
    ``xadd_enqueue``: each step enqueued as one plain ``XADD`` of its entry instead of ``enqueue.lua``,
    its fields as ``enqueue.lua`` writes them (``full``) or three (``packed``)."""

    def __init__(self, redis: Redis, sources: dict[str, str] | None, *, xadd_enqueue: str | None = None) -> None:
        self.redis = redis
        self.keys = CellKeys("rf", "bench")
        self.scripts = Scripts(redis, self.keys, sources=sources)
        self.xadd_enqueue = xadd_enqueue
        self.sessions: list[str] = []
        self.next_step: dict[str, int] = {}
        self.entry_fields: dict[str, tuple[bytes, bytes]] = {}  # per session: its epoch and generation
        self.turn = 0
        self.script_us = 0.0
        self.main_us = 0.0

    async def start(self, sessions: int) -> None:
        # described as a worker of this release describes itself: it reads packed inbox entries
        await self.scripts.register(WORKER, capacity=sessions, pools=[self.keys.pool(MODE, MODEL)], ttl_ms=600_000,
                                    fields={"state": "active", READS_FIELD: READS_PACKED})
        for i in range(sessions):
            sid = f"s-{i:06d}-step-scripts"
            created = await self.scripts.create(sid, MODE, MODEL, lease_ms=600_000, retention="full", result_window=1)
            if not isinstance(created, Created) or created.owner != WORKER:
                raise RuntimeError(f"session {sid} was not placed on the bench worker: {created}")
            self.sessions.append(sid)
            self.next_step[sid] = 0
            epoch, gen = await self.redis.hmget(self.keys.session(sid), ["epoch", "gen"])
            self.entry_fields[sid] = (epoch, gen)

    async def round(self, batch: int) -> None:
        """One batch of steps, enqueued, read and committed; raises unless every one commits."""
        start = self.turn * batch % len(self.sessions)
        self.turn += 1
        group = [self.sessions[(start + i) % len(self.sessions)] for i in range(batch)]
        if self.xadd_enqueue:
            await self._xadd(group)
        else:
            queued = await asyncio.gather(*(
                self.scripts.enqueue(sid, WORKER, step_id=self.next_step[sid], contextual=True,
                                     job_id=f"j-{sid}-{self.next_step[sid]}", reply_to=REPLY_TO, payload=PAYLOAD)
                for sid in group))
            if not all(isinstance(reply, Queued) for reply in queued):
                raise RuntimeError(f"an enqueue was refused: {queued}")
        read = await self.redis.xreadgroup(INBOX_GROUP, WORKER, {self.keys.inbox(WORKER): ">"}, count=batch)
        entries = read[0][1] if read else []
        calls = [self._commit_call(entry_id, fields) for entry_id, fields in entries]
        committed = await asyncio.gather(*(self.scripts.commit(call) for call in calls))
        if len(committed) != batch or not all(isinstance(reply, Committed) for reply in committed):
            raise RuntimeError(f"a commit did not land: {committed}")
        await self.redis.xtrim(self.keys.reply(REPLY_TO), maxlen=0)
        for sid in group:
            self.next_step[sid] += 1

    @staticmethod
    def _commit_call(entry_id: bytes, fields: dict[bytes, bytes]) -> CommitCall:
        """The worker's commit of an inbox entry: one ``enqueue.lua`` wrote (either layout), or one
        ``--xadd-enqueue packed`` did (``m``)."""
        if b"m" in fields:
            _, job_id, step_id, _, epoch = fields[b"m"].split(b"\0")[:5]
        else:
            entry = InboxEntry.from_fields(entry_id, fields)
            job_id, step_id, epoch = entry.job_id.encode(), str(entry.step_id).encode(), str(entry.epoch).encode()
        return CommitCall(session_id=fields[b"session_id"].decode(), worker_id=WORKER, epoch=int(epoch),
                          step_id=int(step_id), entry_id=entry_id.decode(), result=RESULT,
                          context_length=int(step_id) + 1, job_id=job_id.decode(), reply_to=REPLY_TO,
                          reply_ttl_ms=60_000, record=RECORD)

    async def _xadd(self, group: list[str]) -> None:
        """The batch's steps as plain inbox entries, in one pipeline: the entry ``enqueue.lua`` writes
        for a common step to this worker (packed: broker/redis/layouts.py ``PACKED``), or the three
        fields of ``packed``; none of its reads or checks."""
        pipe = self.redis.pipeline(transaction=False)
        now = str(int(time.time() * 1000)).encode()
        for sid in group:
            step = str(self.next_step[sid]).encode()
            job_id = b"j-" + sid.encode() + b"-" + step
            epoch, gen = self.entry_fields[sid]
            if self.xadd_enqueue == "packed":
                packed = b"\0".join((b"step", job_id, step, b"1", epoch, gen, MODE.encode(), MODEL.encode(),
                                      REPLY_TO.encode(), now, b"0"))
                pipe.xadd(self.keys.inbox(WORKER), {"session_id": sid, "m": packed, "payload": PAYLOAD})
                continue
            parts = {"kind": b"step", "step_id": step, "contextual": b"1", "gen": gen, "mode": MODE.encode(),
                     "enqueued_ms": now, "attempt": b"0", "model": MODEL.encode()}
            pipe.xadd(self.keys.inbox(WORKER), {
                "session_id": sid, "epoch": epoch, "job_id": job_id, "reply_to": REPLY_TO,
                PACKED: b"\0".join(parts[name] for name in PACKED_PARTS), "payload": PAYLOAD})
        await pipe.execute()

    async def counters(self) -> tuple[float, float]:
        """(EVALSHA µs so far, main-thread CPU µs so far)."""
        stats = await self.redis.info("commandstats")
        cpu = await self.redis.info("cpu")
        script = float(stats.get("cmdstat_evalsha", {}).get("usec", 0))
        return script, 1e6 * (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]))


async def measure(size: str, baseline: str, batch: int, callgrind: Callgrind | None = None, *,
                  xadd_enqueue: str | None = None) -> list[Row]:
    """This checkout's scripts against ``baseline``'s, or (``xadd_enqueue``: ``full`` or ``packed``)
    against this checkout's commit behind a plain ``XADD`` enqueue, the other side then named as in
    :data:`XADD_SIDES`."""
    cfg = SIZE[size]
    baseline, sources = ((XADD_SIDES[xadd_enqueue], None) if xadd_enqueue
                         else (baseline, revision_sources(baseline)))
    wrapper = callgrind.wrapper() if callgrind is not None else []
    with private_redis(wrapper) as this_server, private_redis(wrapper) as base_server:
        pids = {"this checkout": _pid(this_server), baseline: _pid(base_server)}
        clients = [open_redis(this_server.url, decode_responses=False), open_redis(base_server.url,
                                                                                   decode_responses=False)]
        try:
            sides = {"this checkout": Side(clients[0], None),
                     baseline: Side(clients[1], sources, xadd_enqueue=xadd_enqueue)}
            for side in sides.values():
                await side.start(cfg.sessions)
                for _ in range(max(2, cfg.rounds)):  # warm: scripts loaded, streams and hashes grown
                    await side.round(batch)
                # Both start from a collected Lua heap: neither pays in its window for garbage the
                # warm-up left (a collection is ~6,000 instructions a step at smoke size).
                await side.redis.eval(COLLECT_LUA_GARBAGE, 0)
            if callgrind is not None:
                for pid in pids.values():
                    callgrind.on(pid)
            for _ in range(cfg.chunks):
                for side in sides.values():
                    script0, main0 = await side.counters()
                    for _ in range(cfg.rounds):
                        await side.round(batch)
                    script1, main1 = await side.counters()
                    side.script_us += script1 - script0
                    side.main_us += main1 - main0
            counted = {name: callgrind.counts(pid) for name, pid in pids.items()} if callgrind is not None else {}
        finally:
            for client in clients:
                await client.aclose()
    steps = cfg.chunks * cfg.rounds * batch  # per side: a round commits its whole batch or raises
    if callgrind is not None:
        return instruction_rows(counted, steps, batch, baseline)
    return timed_rows(sides, steps, batch, baseline)


def timed_rows(sides: dict[str, Side], steps: int, batch: int, baseline: str) -> list[Row]:
    """Per step and side: the scripts' time and the master's main-thread CPU; then the ratio."""
    rows = []
    per_step: dict[str, tuple[float, float]] = {}
    for name, side in sides.items():
        per_step[name] = (side.script_us / steps, side.main_us / steps)
        rows.append(Row(NAME, f"token step, batch of {batch}", f"scripts @ {name}",
                        {"scripts_us": per_step[name][0], "main_thread_us": per_step[name][1], "steps": steps},
                        unit="µs/step"))
    this, base = per_step["this checkout"], per_step[baseline]
    rows.append(Row(NAME, f"token step, batch of {batch}", f"this checkout / {baseline}",
                    {"scripts": this[0] / base[0], "main_thread": this[1] / base[1]}, unit="ratio"))
    return rows


def instruction_rows(counted: dict[str, dict[str, int]], steps: int, batch: int, baseline: str) -> list[Row]:
    """Per step and side: instructions in all, in the scripts and in what they call, the scripts'
    own, outside the scripts; then this checkout's over the baseline's."""
    rows, per_step = [], {}
    for name, c in counted.items():
        values = {"total": c["total"] / steps, "scripts": c["scripts"] / steps,
                  "commands_in_scripts": c["commands_in_scripts"] / steps,
                  "scripts_own": (c["scripts"] - c["commands_in_scripts"]) / steps,
                  "outside_scripts": (c["total"] - c["scripts"]) / steps}
        per_step[name] = values
        rows.append(Row(NAME, f"token step, batch of {batch}", f"instructions @ {name}", {**values, "steps": steps},
                        unit="instructions/step"))
    this, base = per_step["this checkout"], per_step[baseline]
    rows.append(Row(NAME, f"token step, batch of {batch}", f"this checkout / {baseline}",
                    {key: this[key] / base[key] for key in this if base[key]}, unit="ratio"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZE), default="smoke")
    parser.add_argument("--baseline", default=None,
                        help="the revision whose create.lua, enqueue.lua and commit.lua to compare (default HEAD)")
    parser.add_argument("--batch", type=int, default=8, help="steps per script call (one event-loop turn's)")
    parser.add_argument("--callgrind", action="store_true",
                        help="count the servers' instructions under valgrind's callgrind instead of timing them")
    parser.add_argument("--xadd-enqueue", nargs="?", const="full", choices=sorted(XADD_SIDES),
                        help="compare with this checkout's commit behind a plain XADD enqueue instead of a revision,"
                             " the entry's fields as enqueue.lua writes them (full, the default) or three (packed)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        print(f"{NAME}: --batch must be at least 1", file=sys.stderr)
        return 2
    if args.xadd_enqueue and args.baseline is not None:
        print(f"{NAME}: --xadd-enqueue compares with this checkout, not with --baseline", file=sys.stderr)
        return 2
    if args.callgrind and (missing := Callgrind.missing()):
        print(f"{NAME}: {missing}", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rollout-fleet-callgrind-") as directory:
        rows = asyncio.run(measure(args.size, args.baseline or "HEAD", args.batch,
                                   Callgrind(directory, FUNCTIONS) if args.callgrind else None,
                                   xadd_enqueue=args.xadd_enqueue))
    print(format_table(rows))
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
