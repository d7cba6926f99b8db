"""Dead letters: list, inspect and re-enqueue failed step jobs.

A replay goes through the same enqueue script as a trainer's step, so the ordering and commit
rules hold: replaying twice, or replaying a step that has since been committed, changes nothing
and says so. A replayed job leaves the dead-letter stream once it is queued (if it fails again it
is dead-lettered again) or once its step is found committed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.redis.aio import resolve
from broker.redis.layouts import DeadLetter, SessionHash
from broker.redis.script_replies import Moved, Queued, Stored
from broker.redis.scripts import Scripts

# A dead letter as the replay tools call it; its layout belongs to broker.redis.layouts.
DeadJob = DeadLetter


MALFORMED = "malformed_dead_letter"  # the code of a dead letter whose fields do not parse


def read_dead(entry_id: bytes | str, fields: dict[bytes, bytes]) -> DeadJob:
    """One dead letter as written, or, when its fields do not parse (written by hand, by an old
    version, or damaged), a letter that says so: listed with a clear reason, never replayed."""
    try:
        return DeadJob.from_entry(entry_id, fields)
    except ValueError as exc:  # int() of a counter that is not one (LayoutError is one too)
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw_sid = fields.get(b"session_id", b"")
        return DeadJob(reason=f"{MALFORMED}: its attempts or failed_ms is not an integer ({exc})",
                       entry_id=eid, kind="malformed", session_id=raw_sid.decode("utf-8", "replace")[:200])


@dataclass(frozen=True)
class ReplayOutcome:
    entry_id: str
    session_id: str
    step_id: int | None
    status: str  # queued | already_committed | dry_run | not_found | not_replayable | an error code
    message: str


async def list_dead(scripts: Scripts, *, session: str | None = None, code: str | None = None,
                    older_than_s: float | None = None, newer_than_s: float | None = None,
                    limit: int = 1000) -> list[DeadJob]:
    """Dead-lettered jobs, oldest first, filtered by session, error code and age."""
    now_ms = time.time() * 1000
    raw: Any = await scripts.redis.xrange(scripts.keys.dead, "-", "+")
    out = []
    for entry_id, fields in raw:
        job = read_dead(entry_id, fields)
        age_s = (now_ms - job.failed_ms) / 1000 if job.failed_ms else float("inf")
        if session and job.session_id != session:
            continue
        if code and job.code != code:
            continue
        if older_than_s is not None and age_s < older_than_s:
            continue
        if newer_than_s is not None and age_s > newer_than_s:
            continue
        out.append(job)
        if len(out) >= limit:
            break
    return out


async def show(scripts: Scripts, entry_id: str) -> DeadJob | None:
    raw: Any = await scripts.redis.xrange(scripts.keys.dead, entry_id, entry_id)
    return read_dead(raw[0][0], raw[0][1]) if raw else None


async def replay_one(scripts: Scripts, job: DeadJob, *, dry_run: bool = False) -> ReplayOutcome:
    def outcome(status: str, message: str) -> ReplayOutcome:
        return ReplayOutcome(job.entry_id, job.session_id, job.step_id, status, message)

    if not job.replayable or job.step_id is None:
        return outcome("not_replayable", job.not_replayable_why)
    if dry_run:
        return outcome("dry_run", f"would re-enqueue step {job.step_id} of {job.session_id}")
    raw: Any = await resolve(scripts.redis.hgetall(scripts.keys.session(job.session_id)))
    owner = SessionHash.from_fields(raw).owner if raw else ""  # a missing session: enqueue says so
    for _ in range(8):
        reply = await scripts.enqueue(job.session_id, owner, step_id=job.step_id, contextual=job.contextual,
                                      job_id=f"replay-{uuid.uuid4().hex}", reply_to=job.reply_to or "replay",
                                      payload=job.payload, attempt=job.attempts)
        if not isinstance(reply, Moved):
            break
        owner = reply.owner
    if isinstance(reply, Queued | Stored):
        await scripts.redis.xdel(scripts.keys.dead, job.entry_id)
        if isinstance(reply, Stored):
            return outcome("already_committed", "the step is committed; its stored result stands")
        return outcome("queued", f"re-enqueued step {job.step_id}; its result is committed as usual")
    if isinstance(reply, Moved):  # it kept moving: answer as a refusal would
        return outcome("moved", f"session {job.session_id} kept moving between workers (now {reply.owner})")
    code, message = reply.code.value, reply.message
    if code == "step_already_committed":
        await scripts.redis.xdel(scripts.keys.dead, job.entry_id)
        return outcome("already_committed", message)
    return outcome(code, message)


async def replay(scripts: Scripts, jobs: Sequence[DeadJob], *, dry_run: bool = False) -> list[ReplayOutcome]:
    """Replay jobs in order (oldest first keeps each session's steps in order)."""
    return [await replay_one(scripts, job, dry_run=dry_run) for job in jobs]


async def replay_ids(scripts: Scripts, entry_ids: Sequence[str], *, dry_run: bool = False) -> list[ReplayOutcome]:
    outcomes = []
    for entry_id in entry_ids:
        job = await show(scripts, entry_id)
        if job is None:
            outcomes.append(ReplayOutcome(entry_id, "", None, "not_found",
                                          "not in the dead-letter stream (already replayed or removed)"))
            continue
        outcomes.append(await replay_one(scripts, job, dry_run=dry_run))
    return outcomes
