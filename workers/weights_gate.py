"""Weight updates without half-updated steps: steps pass a gate; an update closes it, waits until
no step is inside the engine, loads the weights, and opens it again. A step that needs a minimum
policy version waits at the gate until the engine has it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from workers.engines.base import Engine


class WeightGate:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def step(self, min_version: int = 0) -> AsyncIterator[int]:
        """Hold the engine for one step; yields the policy version the step runs with."""
        while True:
            await self._open.wait()
            if self.engine.policy_version >= min_version:
                break
            changed = self._changed
            await changed.wait()
        self._running += 1
        self._idle.clear()
        try:
            yield self.engine.policy_version
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    async def update(self, path: str, version: int) -> None:
        """Pause intake, let running steps finish, load, resume."""
        self._open.clear()
        try:
            await self._idle.wait()
            await self.engine.load_weights(path, version)
        finally:
            self._open.set()
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
