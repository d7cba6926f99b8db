"""A worker's side of the control stream: apply weight updates for the models it serves."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from redis.asyncio import Redis

from broker.ops.weights import WeightUpdate, weights_error_prefix
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.keys import CellKeys
from workers.engines.base import Engine
from workers.weights_gate import WeightGate

log = logging.getLogger(__name__)


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
