"""The fleet's controller: one named, detached Ray actor per fleet that places, scales and drains
its worker actors.

Why an actor and not the caller: ``status``, ``scale`` and ``down`` come from other processes than
``up`` (a CLI run later, a trainer's driver), and Ray finds placement groups by name only inside
the namespace that made them. The controller makes every placement group and worker actor in its
own namespace (:data:`~workers.ray_fleet.spec.NAMESPACE`) and is itself found by the fleet's name.

State: the workers and placement groups, each named after the fleet (``NAME:gG:bB:wI``: worker I
in bundle B of group G). When Ray restarts the controller (its node was lost) it rebuilds that
state from the names (:meth:`FleetController._recover`), so a restart loses nothing.

Placement: each ``up`` or ``scale`` up makes one placement group of one bundle per new worker
(``PACK`` or ``SPREAD`` over the nodes) and one worker actor per bundle, so the GPUs of a worker
are reserved by Ray before its process starts. A group is given back when its last worker goes.

Draining: ``scale`` down and ``down`` drain the workers they stop (SIGTERM: the worker hands its
sessions over to live workers and exits, bounded by its drain timeout), and only then kill the
actor (no restart) and give back its bundle. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from broker.redis.config import CellConfig
from workers.ray_fleet.actor import DRAIN_MARGIN_S, WorkerActor
from workers.ray_fleet.autoscale import Autoscale, FleetLoad, fleet_load
from workers.ray_fleet.spec import (
    NAMESPACE,
    FleetSpec,
    group_name,
    parse_group_name,
    parse_worker_name,
    worker_name,
)

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 4  # a worker actor answers info() while drain() waits
INFO_TIMEOUT_S = 15.0  # a worker actor that does not answer info() within this is shown unreachable
KILL_TIMEOUT_S = 30.0


@dataclass
class _Placed:
    group: int
    bundle: int
    handle: Any  # the worker actor's Ray handle


class FleetController:
    """Places the workers of one fleet on the Ray cluster; its methods answer plain dicts."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self.spec = FleetSpec.from_plain(spec)
        self._lock = threading.RLock()  # one change at a time (set_count holds it across add/remove)
        self._groups: dict[int, Any] = {}  # group -> placement group
        self._workers: dict[int, _Placed] = {}  # worker index -> where it is placed
        self._recover()
        if self.spec.autoscale is not None:
            threading.Thread(target=self._autoscale_loop, args=(self.spec.autoscale,), daemon=True,
                             name="rollout-fleet-autoscale").start()

    def _recover(self) -> None:
        """Find this fleet's worker actors and placement groups by their names (after a restart)."""
        import ray
        from ray.util import get_placement_group, placement_group_table

        for entry in ray.util.list_named_actors(all_namespaces=True):
            parsed = parse_worker_name(self.name, entry["name"]) if entry["namespace"] == NAMESPACE else None
            if parsed is not None:
                group, bundle, index = parsed
                handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
                self._workers[index] = _Placed(group, bundle, handle)
        for table in placement_group_table().values():
            found = parse_group_name(self.name, table.get("name", ""))
            if found is not None and table.get("state") != "REMOVED":
                self._groups[found] = get_placement_group(table["name"])
        self._release_empty_groups()
        if self._workers:
            log.warning("fleet %s: controller restarted, found %d workers in %d groups",
                        self.name, len(self._workers), len(self._groups))

    def ping(self) -> str:
        return self.name

    def spec_plain(self) -> dict[str, Any]:
        return self.spec.plain()

    def add(self, count: int) -> list[int]:
        """Place ``count`` more workers in one new placement group; their indices."""
        import ray
        from ray.util import placement_group, remove_placement_group

        if count <= 0:
            return []
        with self._lock:
            group = max(self._groups, default=-1) + 1
            pg = placement_group([self.spec.bundle()] * count, strategy=self.spec.placement.ray_strategy,
                                 name=group_name(self.name, group), lifetime="detached")
            if not pg.wait(self.spec.place_timeout_s):
                remove_placement_group(pg)
                raise RuntimeError(f"the Ray cluster could not place {count} x {self.spec.bundle()} "
                                   f"({self.spec.placement.value}) within {self.spec.place_timeout_s:g} s")
            self._groups[group] = pg
            first = max(self._workers, default=-1) + 1
            for bundle in range(count):
                self._start_worker(group, bundle, first + bundle)
            added = list(range(first, first + count))
        log.info("fleet %s: placed workers %s in group %d", self.name, added, group)
        ray.get([self._workers[i].handle.info.remote() for i in added], timeout=self.spec.place_timeout_s)
        return added

    def _start_worker(self, group: int, bundle: int, index: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        actor = ray.remote(WorkerActor).options(
            name=worker_name(self.name, group, bundle, index), namespace=NAMESPACE, lifetime="detached",
            max_restarts=spec.max_restarts, max_concurrency=ACTOR_CONCURRENCY,
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._groups[group], placement_group_bundle_index=bundle))
        handle = actor.remote(index, dict(spec.worker_env), f"ray-{self.name}", spec.drain_timeout_s)
        self._workers[index] = _Placed(group, bundle, handle)

    def remove(self, count: int) -> dict[int, int | str | None]:
        """Drain and stop the ``count`` newest workers; each one's drain outcome (exit status, None
        when it had to be killed, or why it could not be asked)."""
        with self._lock:
            chosen = sorted(self._workers, reverse=True)[:max(count, 0)]
            outcome = self._drain(chosen)
            for index in chosen:
                self._kill(self._workers.pop(index).handle)
            self._release_empty_groups()
        log.info("fleet %s: drained and stopped workers %s", self.name, chosen)
        return outcome

    def _drain(self, indices: Iterable[int]) -> dict[int, int | str | None]:
        """SIGTERM every chosen worker at once and wait for all, bounded."""
        import ray

        refs = {index: self._workers[index].handle.drain.remote() for index in indices}
        bound = self.spec.drain_timeout_s + 2 * DRAIN_MARGIN_S
        outcome: dict[int, int | str | None] = {}
        for index, ref in refs.items():
            try:
                outcome[index] = ray.get(ref, timeout=bound)
            except (ray.exceptions.RayError, TimeoutError) as exc:  # a dead actor: its lease moves its sessions
                outcome[index] = f"not drained: {type(exc).__name__}"
        return outcome

    def _kill(self, handle: Any) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except (ValueError, ray.exceptions.RayError) as exc:  # already gone
            log.info("fleet %s: kill of a worker actor: %s", self.name, exc)

    def _release_empty_groups(self) -> None:
        from ray.util import remove_placement_group

        used = {placed.group for placed in self._workers.values()}
        for group in [g for g in self._groups if g not in used]:
            remove_placement_group(self._groups.pop(group))

    def workers(self) -> list[dict[str, Any]]:
        """Every worker actor as its ``info()`` says, or unreachable (restarting, its node lost)."""
        import ray

        placed = dict(self._workers)
        if not placed:
            return []
        refs = {index: p.handle.info.remote() for index, p in placed.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=INFO_TIMEOUT_S)
        rows = []
        for index, ref in sorted(refs.items()):
            base = {"index": index, "group": placed[index].group, "bundle": placed[index].bundle}
            try:
                rows.append({**base, **ray.get(ref, timeout=0.1), "reachable": True})
            except (ray.exceptions.RayError, TimeoutError) as exc:
                rows.append({**base, "reachable": False, "error": type(exc).__name__})
        return rows

    def count(self) -> int:
        return len(self._workers)

    def set_count(self, workers: int) -> dict[str, Any]:
        """Add workers, or drain and stop the newest, until ``workers`` run: what was done."""
        with self._lock:
            now = len(self._workers)
            if workers > now:
                return {"added": self.add(workers - now), "drained": {}}
            return {"added": [], "drained": self.remove(now - workers) if workers < now else {}}

    def _autoscale_loop(self, policy: Autoscale) -> None:
        """Check the fleet's fill every ``policy.interval_s`` and scale toward it (autoscale.py)."""
        import ray

        cell = CellConfig.from_env(self.spec.worker_env)
        low = 0  # checks in a row that wanted fewer workers
        while True:
            time.sleep(policy.interval_s)
            try:
                low = self._autoscale_once(policy, cell, low)
            except (RedisError, OSError, RuntimeError, ray.exceptions.RayError) as exc:  # RuntimeError: no room
                log.warning("fleet %s: autoscaling check failed: %s", self.name, exc)

    def _autoscale_once(self, policy: Autoscale, cell: CellConfig, low: int) -> int:
        load = asyncio.run(fleet_load(cell, self.name))
        with self._lock:  # the count cannot change between this look and the change it leads to
            return self._autoscale_step(policy, load, low)

    def _autoscale_step(self, policy: Autoscale, load: FleetLoad, low: int) -> int:
        current = len(self._workers)
        wanted = policy.wanted(load.sessions, load.capacity_each)
        if load.capacity_each == 0:  # none live yet (starting) or all lost: never a reason to drain
            wanted = max(wanted, current)
        if wanted > current:
            log.info("fleet %s: %d sessions want %d workers: adding %d", self.name, load.sessions, wanted,
                     wanted - current)
            self.set_count(wanted)
            return 0
        if wanted == current:
            return 0
        if low + 1 < policy.down_after:
            return low + 1
        log.info("fleet %s: %d sessions want %d workers: draining %d", self.name, load.sessions, wanted,
                 current - wanted)
        self.set_count(wanted)
        return 0
