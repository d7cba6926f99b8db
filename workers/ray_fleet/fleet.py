"""``RayFleet``: the fleet's workers on a Ray cluster, from any process that can reach it.

For a trainer whose driver already holds a Ray cluster (verl, AReaL, slime, SkyRL start their
rollout engines this way), after its own ``ray.init``::

    from broker.redis.config import CellConfig
    from workers.ray_fleet import FleetSpec, RayFleet, worker_env

    fleet = RayFleet("rollout-fleet")
    env = worker_env(CellConfig(redis_url=url), "vllm", engine_options={"model": "/ckpt"}, gpu=True)
    fleet.up(FleetSpec(worker_env=env, num_gpus=1), workers=8)
    ...
    fleet.scale(4)   # drains four workers: their sessions move, nothing is lost
    fleet.down()     # drains them all, gives every GPU back

Without a Ray connection in the process, the first call connects to ``address`` (``auto``: the
cluster this node belongs to, or ``$RAY_ADDRESS``). The same calls back ``rollout-fleet ray``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from broker.ops.status import cell_status
from broker.redis.config import CellConfig
from workers.ray_fleet.controller import FleetController
from workers.ray_fleet.spec import DEFAULT_NAME, NAMESPACE, FleetSpec, check_name

CALL_TIMEOUT_S = 60.0  # a controller call that neither places nor drains
CONNECT_TIMEOUT_S = 10.0  # a Ray address given as host:port must accept a connection within this
RETRY_S = 1.0  # between two tries of a call while the controller restarts
GONE_TIMEOUT_S = 30.0  # a killed controller's name is free again within this (Ray frees it asynchronously)
HEAD_NODE = "node:__internal_head__"  # the controller lives on the head node, the one the cluster cannot lose
CONTROLLER_CONCURRENCY = 4  # status answers while a scale waits on placement or drains


class RayFleetError(Exception):
    """An expected failure, said in one line: no Ray cluster, no such fleet, no room on the cluster."""


class _Restarting(Exception):
    """The controller did not answer: Ray is restarting it, or it is gone for good."""


@dataclass(frozen=True)
class FleetReport:
    """A fleet as its controller sees it: each worker actor's index, group, node, process and id."""

    name: str
    spec: dict[str, Any]  # num_gpus, num_cpus, placement, engine (never the worker environment)
    workers: list[dict[str, Any]]

    @property
    def worker_ids(self) -> list[str]:
        return [w["worker_id"] for w in self.workers if w.get("reachable") and w.get("running")]


class RayFleet:
    """One fleet of workers on a Ray cluster, known by its name."""

    def __init__(self, name: str = DEFAULT_NAME, *, address: str | None = None) -> None:
        self.name = check_name(name)
        self.address = address

    def _connect(self) -> None:
        if self.address:
            reachable(self.address)
        import ray

        if ray.is_initialized():
            return
        try:
            ray.init(address=self.address or "auto", namespace=NAMESPACE, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise RayFleetError(f"no Ray cluster at {self.address or 'auto'}: {exc}") from None

    def _controller(self) -> Any:
        self._connect()
        import ray

        try:
            return ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            raise RayFleetError(f"no fleet named {self.name!r} on this Ray cluster (rollout-fleet ray up)") from None

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S, controller: Any = None) -> Any:
        """One controller call. While Ray restarts the controller (its node was lost) the call is
        tried again, within the same ``timeout``: every method called this way is safe to repeat."""
        controller = controller or self._controller()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._call_once(controller, method, args, max(deadline - time.monotonic(), 1.0))
            except _Restarting as exc:
                if time.monotonic() > deadline:
                    raise RayFleetError(f"fleet {self.name!r}: its controller is not reachable ({exc})") from None
                time.sleep(RETRY_S)

    def _call_once(self, controller: Any, method: str, args: tuple[Any, ...], timeout: float) -> Any:
        import ray

        try:
            return ray.get(getattr(controller, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            raise RayFleetError(str(getattr(exc, "cause", exc)).strip().splitlines()[-1]) from None
        except ray.exceptions.GetTimeoutError:
            raise RayFleetError(f"fleet {self.name!r}: {method} did not answer within {timeout:g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise _Restarting(str(exc).splitlines()[0]) from None

    def up(self, spec: FleetSpec, workers: int) -> FleetReport:
        """Start the fleet's controller and ``workers`` worker actors; refused when the fleet is up."""
        self._connect()
        import ray

        with contextlib.suppress(ValueError):
            ray.get_actor(self.name, namespace=NAMESPACE)
            raise RayFleetError(f"fleet {self.name!r} is already up: scale it, or take it down first")
        controller = ray.remote(FleetController).options(
            name=self.name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, num_cpus=0,
            resources={HEAD_NODE: 0.001}, max_concurrency=CONTROLLER_CONCURRENCY).remote(self.name, spec.plain())
        try:
            self._call("set_count", workers, timeout=_placing_bound(spec), controller=controller)
        except RayFleetError:  # no room: nothing of the fleet stays behind
            self._call("set_count", 0, timeout=_draining_bound(spec), controller=controller)
            self._kill(controller)
            raise
        return self.status()

    def status(self) -> FleetReport:
        spec = self._call("spec_plain")
        rows = self._call("workers")
        shown = {key: spec[key] for key in ("num_gpus", "num_cpus", "placement", "max_restarts")}
        engine = spec["worker_env"].get("ROLLOUT_FLEET_ENGINE", "reference")
        return FleetReport(self.name, {**shown, "engine": engine}, rows)

    def scale(self, workers: int) -> FleetReport:
        """Add workers, or drain and stop the newest ones, until ``workers`` run. With autoscaling
        on, the autoscaler moves the count on from there within its bounds."""
        if workers < 0:
            raise RayFleetError(f"--workers must be 0 or more, got {workers}")
        spec = FleetSpec.from_plain(self._call("spec_plain"))
        self._call("set_count", workers, timeout=max(_placing_bound(spec), _draining_bound(spec)))
        return self.status()

    def down(self) -> dict[int, int | str | None]:
        """Drain and stop every worker, give their bundles back, stop the controller; each
        worker's drain outcome."""
        spec = FleetSpec.from_plain(self._call("spec_plain"))
        done: dict[str, Any] = self._call("set_count", 0, timeout=_draining_bound(spec))
        outcome: dict[int, int | str | None] = done["drained"]
        self._kill(self._controller())
        return outcome

    def _kill(self, controller: Any) -> None:
        """Kill the controller and return once its name is free: Ray marks a killed actor dead
        asynchronously, and until then the fleet still looks up (an ``up`` of the same name right
        after a ``down`` would be refused as "already up")."""
        import ray

        ray.kill(controller, no_restart=True)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(self.name, namespace=NAMESPACE)
            except ValueError:
                return
            time.sleep(0.1)
        raise RayFleetError(f"fleet {self.name!r}: its controller was killed but its name is still taken after "
                            f"{GONE_TIMEOUT_S:g} s")


def reachable(address: str) -> None:
    """Fail now when nothing answers at a ``host:port`` (or ``ray://host:port``) address: Ray's own
    connect retries a missing GCS for minutes. Other forms (``auto``) are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayFleetError(f"no Ray cluster answers at {address} ({exc})") from None


def _placing_bound(spec: FleetSpec) -> float:
    return 2 * spec.place_timeout_s + CALL_TIMEOUT_S


def _draining_bound(spec: FleetSpec) -> float:
    from workers.ray_fleet.actor import DRAIN_MARGIN_S

    return spec.drain_timeout_s + 3 * DRAIN_MARGIN_S + CALL_TIMEOUT_S


async def live_in_cell(cell: CellConfig, worker_ids: Iterable[str]) -> set[str]:
    """Which of ``worker_ids`` are live workers of ``cell`` now (registered, heartbeat within the
    lease, not stopped)."""
    report = await cell_status(config=cell)
    wanted = set(worker_ids)
    return {w.worker_id for w in report.workers if w.worker_id in wanted and w.live(cell.lease_ms)
            and w.fields.get("state") == "active"}


async def wait_live(cell: CellConfig, fleet: RayFleet, count: int, timeout_s: float) -> FleetReport:
    """Wait until ``count`` of the fleet's workers are live in ``cell``; the last report. Raises
    TimeoutError naming how many are, past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = await asyncio.to_thread(fleet.status)
        live = await live_in_cell(cell, report.worker_ids)
        if len(live) >= count:
            return report
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(live)} of {count} workers live in the cell after {timeout_s:g} s")
        await asyncio.sleep(0.5)
