"""Weight updates on a worker: its side of the control stream, and the gate its steps pass.

``WeightControl`` follows the control stream and applies the weight updates for the models the
worker serves. ``WeightGate`` keeps half-updated steps out: steps pass a gate; an update closes
it, waits until no step is inside the engine (letting running steps finish, or aborting them),
loads the weights, and opens it again. A step that needs a minimum policy version waits at the
gate until the engine has it. An aborted step leaves the gate, waits for it to open, and runs
again on the new weights (whole, or from the tokens it had generated:
``workers.executor.Continuation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis

from broker.ops.weights import WeightUpdate, weights_error_prefix
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling, wait_set
from broker.redis.keys import CellKeys
from workers.engines.base import Engine

log = logging.getLogger(__name__)
ABORT_REPEAT_S = 0.05  # how often an aborting update re-aborts steps that reached the engine late


class VersionWaitEnded(Exception):
    """A step stopped waiting at the gate for a policy version the engine does not have."""

    def __init__(self, wanted: int, current: int, *, stopped: bool) -> None:
        super().__init__(f"policy version {wanted} was not reached (the worker has version {current})")
        self.wanted = wanted
        self.current = current
        self.stopped = stopped  # told to stop (a close, a drain) rather than timed out


class InGate:
    """``async with`` for a step :meth:`WeightGate.enter_now` let in: yields its policy version and
    leaves the gate on the way out, whatever ends the block."""

    __slots__ = ("_gate", "version")

    def __init__(self, gate: WeightGate, version: int) -> None:
        self._gate = gate
        self.version = version

    async def __aenter__(self) -> int:
        return self.version

    async def __aexit__(self, *exc_info: object) -> None:
        self._gate.leave()


class WeightGate:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0
        self._changed = asyncio.Event()
        self._aborting = False
        self._keep_partial = False
        self._updating = False

    @contextlib.asynccontextmanager
    async def step(self, min_version: int = 0, *, model: str | None = None, wait_s: float | None = None,
                   stop: asyncio.Event | None = None) -> AsyncIterator[int]:
        """Hold the engine for one step of ``model``; yields the policy version the step runs with
        (``model``'s own; None: the engine-wide one). A step that needs a version the engine does
        not have waits at most ``wait_s`` for it, and no longer than until ``stop`` is set: then
        VersionWaitEnded."""
        deadline = None if wait_s is None else asyncio.get_running_loop().time() + wait_s
        while True:
            await self._open.wait()
            version = self.enter_now(min_version, model=model)  # open now: nothing ran since the wait
            if version is not None:
                break
            await self._wait_for_change(min_version, model, deadline, stop)
        try:
            yield version
        finally:
            self.leave()

    def enter_now(self, min_version: int = 0, *, model: str | None = None) -> int | None:
        """:meth:`step`'s entry where it would not wait (the gate open, ``model`` at ``min_version`` or
        later): the step is inside, holding the policy version returned, until :meth:`leave`. None
        where :meth:`step` would wait (nothing changed). The step path's common case, without the
        two generators of an ``async with`` on :meth:`step`."""
        if not self._open.is_set():
            return None
        version = self._version(model)
        if version < min_version:
            return None
        self._running += 1
        self._idle.clear()
        return version

    def leave(self) -> None:
        """A step entered with :meth:`enter_now` (or :meth:`step`) left the engine."""
        self._running -= 1
        if self._running == 0:
            self._idle.set()

    def _version(self, model: str | None) -> int:
        return self.engine.policy_version if model is None else self.engine.policy_version_of(model)

    async def _wait_for_change(self, min_version: int, model: str | None, deadline: float | None,
                               stop: asyncio.Event | None) -> None:
        """Wait until the weights change; VersionWaitEnded at the deadline or when ``stop`` is set."""
        changed = self._changed  # an update sets this one, then puts a fresh one in its place
        waits = {asyncio.ensure_future(changed.wait())}
        if stop is not None:
            waits.add(asyncio.ensure_future(stop.wait()))
        timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        if changed.is_set():
            return
        if (stop is not None and stop.is_set()) or (deadline is not None
                                                    and asyncio.get_running_loop().time() >= deadline):
            raise VersionWaitEnded(min_version, self._version(model),
                                   stopped=stop is not None and stop.is_set())

    @property
    def running(self) -> int:
        return self._running

    @property
    def updating(self) -> bool:
        """An update holds the gate (draining, aborting or loading): the engine is busy by our own
        request, so a slow or failed health answer now says nothing about it (workers/readiness.py)."""
        return self._updating

    @property
    def aborting(self) -> bool:
        """An update is aborting the steps inside the gate (a StepAborted now is ours)."""
        return self._aborting

    @property
    def keeps_partial(self) -> bool:
        """The aborting update is ``continue``: aborted token steps keep what they generated."""
        return self._aborting and self._keep_partial

    async def update(self, path: str, version: int, *, abort: bool = False, keep_partial: bool = False,
                     model: str | None = None) -> None:
        """Pause intake, let running steps finish (``abort``: abort them; ``keep_partial``: they
        continue from their generated tokens afterwards), load (``model``'s weights only; None: the
        whole engine's), resume."""
        self._open.clear()
        self._updating = True
        try:
            if abort:
                self._aborting, self._keep_partial = True, keep_partial
                await self._abort_until_idle()
            await self._idle.wait()
            if model is None:
                await self.engine.load_weights(path, version)
            else:
                await self.engine.load_model_weights(model, path, version)
        finally:
            self._aborting = self._keep_partial = self._updating = False
            self._open.set()
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def _abort_until_idle(self) -> None:
        """Abort what runs in the engine until no step is inside the gate. Steps that were already
        past the gate but had not reached the engine yet are caught by the next round."""
        while self._running:
            if not await self.engine.abort_running():
                log.info("the %s engine cannot abort steps; waiting for %d to finish",
                         self.engine.kind, self._running)
                return
            await wait_set(self._idle, ABORT_REPEAT_S)




class WeightControl:
    def __init__(self, engine: Engine, redis: Redis, keys: CellKeys, *, block_ms: int = 1000) -> None:
        self.engine = engine
        self.redis = redis
        self.keys = keys
        self.block_ms = block_ms
        self.gate = WeightGate(engine)
        self.error = ""  # why the last update failed (reported in the heartbeat)
        self._cursor = "0-0"

    def fields(self) -> dict[str, str]:
        """The registry hash's view: each model's version (JSON) and the last failure."""
        return {"policy_versions": json.dumps(self.engine.policy_versions(), sort_keys=True),
                "weights_error": self.error}

    async def apply(self, update: WeightUpdate) -> None:
        model = update.model
        if model not in self.engine.models() or update.version <= self.engine.policy_version_of(model):
            return
        log.info("updating %s weights to version %d from %s (in-flight steps: %s)", model,
                 update.version, update.path, update.in_flight)
        try:
            await self.gate.update(update.path, update.version, abort=update.abort,
                                   keep_partial=update.keep_partial, model=model)
            self.error = ""
        except Exception as exc:  # keep serving the old version; say why in the heartbeat
            # "<model> version <n>: ..." is what workers_at_version looks for (broker/ops/weights.py).
            self.error = f"{weights_error_prefix(model, update.version)} {type(exc).__name__}: {exc}"[:300]
            log.exception("%s weight update to version %d failed", model, update.version)

    async def apply_latest(self) -> None:
        """A worker that starts after updates were announced loads the latest one first."""
        raw: Any = await self.redis.xrange(self.keys.control, "-", "+")
        latest: dict[str, WeightUpdate] = {}
        for _, fields in raw:
            update = WeightUpdate.from_fields(fields)
            if update and update.version > getattr(latest.get(update.model), "version", 0):
                latest[update.model] = update
        for update in latest.values():
            await self.apply(update)
        self._cursor = raw[-1][0].decode() if raw else "0-0"

    async def follow(self) -> None:
        """Follow the control stream for as long as the worker lives."""
        while True:
            try:
                resp: Any = await self.redis.xread({self.keys.control: self._cursor}, block=self.block_ms)
            except REDIS_ERRORS as exc:
                raise_if_cancelling()
                log.warning("control stream read failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for entry_id, fields in resp[0][1] if resp else []:
                self._cursor = entry_id.decode()
                update = WeightUpdate.from_fields(fields)
                if update is not None:
                    await self.apply(update)
