"""The worker's heartbeat: its lease kept alive at one Redis command a beat.

Every ``heartbeat_ms`` the worker renews its lease. The common beat is one ``ZADD workers XX CH`` of
the worker's estimate of the Redis clock (:class:`ServerClock`: the ``now`` of its last full
heartbeat plus the monotonic time since). ``XX`` never adds back a worker the reaper retired, and
every score is above the last one written, so ``CH`` answers 0 exactly when the worker is no longer
registered. A full heartbeat (``heartbeat.lua``) runs instead

- every :data:`FULL_BEATS` beats: it sets the clock again, renews the worker hash's expiry (three
  full-heartbeat intervals, at least three leases: :func:`hash_ttl_ms`), and counts the cell's
  workers (the reaper's pace, workers/reaper.py) and the sessions the worker owns (the idle sweep's,
  workers/idle.py);
- as soon as the worker's description or its engine pressure changed (only what changed is
  written), so placement and ``status`` see a change at the next beat, as before;
- when the cheap beat finds the worker unregistered or failed: the full one confirms it, and the
  worker comes back as a new incarnation.

An idle worker so costs its master one command a beat and a six-command script every ten beats,
where each beat used to run the script (seven commands) and raise the cell's registry score (one
more): ``python -m bench.fleet_sim --kinds ""`` measures it.

A worker that owns no session, serves none and runs nothing beats at half the pace
(:func:`idle_heartbeat_ms`: twice the interval, while that stays within 2/5 of the lease): its lease
guards no session, so a late beat can cost none a failover; it still beats well inside its lease,
so placement keeps choosing it. The first session it serves, or its next full heartbeat's count of
sessions it owns, puts it back on the full pace.

The cell's score in the deployment's registry (``rf:cells``, live while a heartbeat is within the
lease: broker/redis/cells.py) is raised at a pace of its own: by one worker at least every half
lease, and in a larger cell by all of them together about :data:`CELL_TOUCHES_PER_LEASE` times a
lease, so the registry's master does not pay for every worker's every beat.

The estimated clock lags Redis's by at most the full heartbeat's round trip: a score written from it
never extends a lease beyond what the worker's liveness earns. A Redis clock stepped forward ages
every worker's score by the step until its next full heartbeat, as it aged the last score of every
worker before; one stepped back leaves its scores ahead by the step, likewise.
"""

from __future__ import annotations

import random
import time

from redis.exceptions import ResponseError

from broker.redis.cells import touch_cell
from broker.redis.refusals import RedisRefused, as_refused
from broker.redis.scripts import Scripts

FULL_BEATS = 10  # beats per full heartbeat while nothing changes
IDLE_PACE = 2  # a worker with no session beats this many times less often...
IDLE_LEASE_SHARE = 0.4  # ...while its beats stay within this share of the lease
CELL_TOUCHES_PER_LEASE = 16  # the cell's registry score, raised by all its workers together, per lease
TOUCH_JITTER = 0.5  # each touch interval is interval * (1 ± TOUCH_JITTER/2)


def hash_ttl_ms(heartbeat_ms: int, lease_ms: int) -> int:
    """The worker hash's expiry: three full-heartbeat intervals, and never under three leases."""
    return 3 * max(lease_ms, FULL_BEATS * heartbeat_ms)


def idle_heartbeat_ms(heartbeat_ms: int, lease_ms: int) -> int:
    """The beat interval of a worker with no session: ``IDLE_PACE`` times the heartbeat, at most
    ``IDLE_LEASE_SHARE`` of the lease, never below the heartbeat (1 s and a 5 s lease: 2 s)."""
    return max(heartbeat_ms, min(IDLE_PACE * heartbeat_ms, int(IDLE_LEASE_SHARE * lease_ms)))


def pressure_text(pressure: float) -> str:
    """The engine pressure as the pressure hash holds it (what decides whether it changed)."""
    return f"{min(1.0, max(0.0, pressure)):.4f}"


class ServerClock:
    """The Redis clock as the worker estimates it: the last time Redis told it, plus the monotonic
    time since it was told. Taken when the reply arrives, so it lags the true clock by at most that
    round trip: a lease it judges expired has expired."""

    def __init__(self) -> None:
        self._server_ms: int | None = None
        self._at = 0.0

    def set(self, server_ms: int) -> None:
        self._server_ms, self._at = server_ms, time.monotonic()

    def now_ms(self) -> int | None:
        """The estimate; None before Redis first told the time."""
        if self._server_ms is None:
            return None
        return self._server_ms + int((time.monotonic() - self._at) * 1000)


class Heartbeats:
    """One worker's heartbeats. ``registered`` after every registration, then ``beat`` once per
    heartbeat interval; ``workers`` and ``owned`` are the last full heartbeat's counts."""

    def __init__(self, scripts: Scripts, *, heartbeat_ms: int, lease_ms: int) -> None:
        self.scripts = scripts
        self.heartbeat_ms = heartbeat_ms
        self.idle_ms = idle_heartbeat_ms(heartbeat_ms, lease_ms)
        self.lease_ms = lease_ms
        self.ttl_ms = hash_ttl_ms(heartbeat_ms, lease_ms)
        self.clock = ServerClock()
        self.workers = 1  # workers registered in the cell
        self.owned = 0  # sessions this worker owns
        self.full_beats = 0  # full heartbeats run (for tests and metrics)
        self._sent: dict[str, str] = {}  # the worker hash's fields as last written
        self._pressure = ""  # the pressure as last written ("" none yet)
        self._score = 0  # the worker's score as last written
        self._cheap_left = 0  # cheap beats before the next full one
        self._touch_at = 0.0  # monotonic time the cell's registry score is due

    def registered(self, now_ms: int, fields: dict[str, str]) -> None:
        """register.lua wrote the worker anew at ``now_ms`` (Redis clock) with ``fields``."""
        self.clock.set(now_ms)
        self._score = now_ms
        self._sent = dict(fields)
        self._pressure = ""
        self._cheap_left = 0  # the first beat is a full one: it writes the pressure, counts the cell
        self._touch_at = time.monotonic() + self._touch_interval_s()  # register raised it just now

    def interval_s(self, *, serving: bool) -> float:
        """The pause before the next beat: the heartbeat while the worker serves or owns a session
        (``serving``: sessions or jobs of its own; ``owned``: the last full heartbeat's count), the
        idle pace otherwise."""
        return (self.heartbeat_ms if serving or self.owned > 0 else self.idle_ms) / 1000.0

    async def beat(self, worker_id: str, fields: dict[str, str], pressure: float) -> bool:
        """One beat; False when the worker is no longer registered (it was declared dead)."""
        level = pressure_text(pressure)
        changed = {name: value for name, value in fields.items() if self._sent.get(name) != value}
        try:
            if self._cheap_left > 0 and not changed and level == self._pressure and await self._keep_alive(worker_id):
                self._cheap_left -= 1
                await self._touch_when_due()
                return True
            beat = await self.scripts.heartbeat(worker_id, ttl_ms=self.ttl_ms, fields=changed,
                                                pressure=None if level == self._pressure else pressure, touch=False)
        except BaseException:
            self._cheap_left = 0  # after a failed beat, a full one
            raise
        if not beat.registered:
            return False
        self.full_beats += 1
        self.clock.set(beat.now_ms)
        self._score = beat.now_ms
        self._sent.update(changed)
        self._pressure = level
        if not beat.described:  # the worker hash had expired: every field goes again, next beat
            self._sent = {}
        self.workers, self.owned = max(1, beat.workers), beat.owned
        self._cheap_left = FULL_BEATS - 1
        await self._touch_when_due()
        return True

    async def _keep_alive(self, worker_id: str) -> bool:
        """The cheap beat: whether the worker is still registered (its score moved)."""
        score = max(self.clock.now_ms() or 0, self._score + 1)
        try:
            changed = await self.scripts.redis.zadd(self.scripts.keys.workers, {worker_id: score}, xx=True, ch=True)
        except ResponseError as exc:  # a refused write (OOM, MISCONF, ...) is noted as a script's is
            refused = as_refused(exc)
            if isinstance(refused, RedisRefused):
                self.scripts.note_refusal(refused)
                raise refused from exc
            raise
        if changed:
            self._score = score
        return bool(changed)

    def _touch_interval_s(self) -> float:
        cell_ms = max(self.lease_ms / 2, self.workers * self.lease_ms / CELL_TOUCHES_PER_LEASE)
        return cell_ms / 1000.0 * (1.0 + TOUCH_JITTER * (random.random() - 0.5))

    async def _touch_when_due(self) -> None:
        if time.monotonic() < self._touch_at:
            return
        await touch_cell(self.scripts.redis, self.scripts.keys, self._score)
        self._touch_at = time.monotonic() + self._touch_interval_s()
