"""A blocking facade over FleetClient for trainers that are not async.

The async client runs on an event loop in a background thread; every call blocks until done.

    with SyncFleetClient("redis://127.0.0.1:6379/0") as fleet:
        s = fleet.create_session(model="reference-lm", mode="tokens")
        r = s.step(0, token_ids=[...])
        futures = [s.submit(i, ...) for i in ...]   # concurrent.futures.Future[StepResult]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from broker.client.fleet import FleetClient
from broker.client.session import CancelOutcome, Session
from schemas.messages import SessionStatus, StepResult

T = TypeVar("T")


class SyncSession:
    def __init__(self, owner: SyncFleetClient, session: Session) -> None:
        self._owner = owner
        self.session = session
        self.session_id = session.session_id
        self.model = session.model
        self.mode = session.mode

    def submit(self, step_id: int, **kwargs: Any) -> concurrent.futures.Future[StepResult]:
        """Enqueue without waiting; steps submitted in order run in order."""

        async def go() -> asyncio.Task[StepResult]:
            return self.session.submit(step_id, **kwargs)

        # Creating the task on the loop thread, in call order, keeps the submit order.
        task = self._owner.call(go())
        return asyncio.run_coroutine_threadsafe(_await(task), self._owner.loop)

    def step(self, step_id: int, **kwargs: Any) -> StepResult:
        return self.submit(step_id, **kwargs).result()

    def reset(self, timeout: float | None = None) -> int:
        return self._owner.call(self.session.reset(timeout=timeout))

    def close(self) -> None:
        self._owner.call(self.session.close())

    def status(self) -> SessionStatus:
        return self._owner.call(self.session.status())

    def fork(self, n: int) -> list[SyncSession]:
        return [SyncSession(self._owner, branch) for branch in self._owner.call(self.session.fork(n))]

    def cancel(self) -> CancelOutcome:
        return self._owner.call(self.session.cancel())


async def _await(task: asyncio.Task[StepResult]) -> StepResult:
    return await task


class SyncFleetClient:
    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        """The same arguments as :class:`FleetClient` (``config=CellConfig(...)`` included)."""
        self._client = FleetClient(url, **kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleet-client-loop", daemon=True)
        self._started = False

    def __enter__(self) -> SyncFleetClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        if not self._started:
            self._thread.start()
            self._started = True
            self.call(self._client.connect())

    def close(self) -> None:
        if not self._started:
            return
        self.call(self._client.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        self._started = False

    @property
    def client(self) -> FleetClient:
        """The async client behind this facade: it lives on ``loop``, so drive it through ``call``."""
        return self._client

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def create_session(self, model: str, mode: str, **kwargs: Any) -> SyncSession:
        return SyncSession(self, self.call(self._client.create_session(model, mode, **kwargs)))

    def attach(self, session_id: str) -> SyncSession:
        return SyncSession(self, self.call(self._client.attach(session_id)))

    def status(self, session_id: str) -> SessionStatus:
        return self.call(self._client.status(session_id))
