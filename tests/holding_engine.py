"""A reference engine that holds its steps at a known point until a weight update aborts them, so
that tests of aborting updates know exactly what ran before the abort (no sleeps, no races).

On policy version 0 only: a language-model step stops after ``hold_after`` generated tokens, and a
world-model step before its forward pass, and waits (at most ``hold_s``) until the engine is asked
to abort. ``signal_path``, when set, is created once a step holds (worker processes); in process,
``held`` is set. Usable as ``--engine tests.holding_engine:HoldingEngine``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from workers.engines.base import EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig, Result


@dataclass(frozen=True)
class HoldingConfig(ReferenceEngineConfig):
    hold_after: int = 0  # generated tokens after which a language-model step holds; 0: never hold
    hold_s: float = 60.0  # the longest hold (then the step goes on)
    signal_path: str = ""


class HoldingEngine(ReferenceEngine):
    config_type = HoldingConfig

    def __init__(self, config: HoldingConfig | None = None) -> None:
        super().__init__(config or HoldingConfig())
        self.hold = config or HoldingConfig()
        self.held = threading.Event()

    def run_direct(self, model: str, requests: Sequence[EngineRequest],
                   should_stop: Callable[[], bool] | None = None,
                   session_stopped: Callable[[str], bool] | None = None) -> list[Result]:
        if should_stop is None or not self.hold.hold_after or self.policy_version_of(model) != 0:
            return super().run_direct(model, requests, should_stop, session_stopped)
        stop = should_stop
        asks = 0

        def holding() -> bool:
            # Asked once before the batch runs, then (language model) before each decode step,
            # i.e. after ``asks - 1`` generated tokens: hold at the chosen point until the abort.
            nonlocal asks
            asks += 1
            if asks == (self.hold.hold_after + 1 if model == "reference-lm" else 1):
                self._wait_for_abort(stop)
            return stop()

        return super().run_direct(model, requests, holding, session_stopped)

    def _wait_for_abort(self, stop: Callable[[], bool]) -> None:
        self.held.set()
        if self.hold.signal_path:
            Path(self.hold.signal_path).touch()
        deadline = time.monotonic() + self.hold.hold_s
        while not stop() and time.monotonic() < deadline:
            time.sleep(0.005)
