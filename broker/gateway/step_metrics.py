"""The gateway's metrics: steps answered through it, by model and outcome, and their round trip
(``rollout_fleet_step_seconds{phase="total"}`` as an HTTP client sees it, minus HTTP itself)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from broker.ops.metrics import FleetMetrics
from schemas.messages import StepResult


class Answered:
    """Receives the step's result inside :meth:`GatewayMetrics.step`."""

    def __init__(self) -> None:
        self._result: StepResult | None = None

    def __call__(self, result: StepResult) -> None:
        self._result = result

    @property
    def result(self) -> StepResult:
        assert self._result is not None, "no result was answered"
        return self._result


class GatewayMetrics:
    def __init__(self) -> None:
        self.fleet = FleetMetrics()

    @contextlib.contextmanager
    def step(self, model: str) -> Iterator[Answered]:
        """Count the step's outcome (committed, duplicate or its error code) and time it. A step that
        raised instead of answering (Redis lost) is not counted here: the route answers it as a 500."""
        answered = Answered()
        started = time.perf_counter()
        yield answered
        result = answered.result
        outcome = "duplicate" if result.duplicate else "committed" if result.ok else _code(result)
        self.fleet.steps.labels(model, outcome).inc()
        self.fleet.step_seconds.labels(model, "total").observe(time.perf_counter() - started)


def _code(result: StepResult) -> str:
    return result.error.code.value if result.error is not None else "unknown"
