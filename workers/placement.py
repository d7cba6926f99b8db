"""What a worker tells placement about itself: its per-model capacity split and its engine pressure.

Placement (``create.lua``, ``broker.ops.failover.placement_candidates``) ranks live workers by
session share (sessions owned over all their pools / capacity) plus engine pressure. Pressure is
the larger of the engine's memory use (KV cache or accelerator memory, where the engine reports
it) and its running steps over the worker's capacity; an engine that does not count its running
steps is measured by the worker's own count of jobs running. Both lie in [0, 1], so a worker full
of sessions and one with every step busy weigh alike.
"""

from __future__ import annotations

from broker.redis.keys import CellKeys
from workers.engines.base import Engine, EngineLoad


def pressure(load: EngineLoad, *, running_jobs: int, capacity: int) -> float:
    """The heartbeat's load signal in [0, 1]."""
    running = load.running_steps if load.running_steps is not None else running_jobs
    busy = min(1.0, running / capacity) if capacity > 0 else 1.0
    memory = min(1.0, max(0.0, load.memory_use)) if load.memory_use is not None else 0.0
    return max(busy, memory)


def pool_caps(engine: Engine, keys: CellKeys, capacity: int) -> dict[str, int]:
    """Pool key -> cap for the models the engine splits its capacity over (register.lua). A cap is
    clamped to [0, capacity]; a model the engine does not serve is ignored."""
    served = engine.models()
    caps = {}
    for model, cap in engine.capacity_split(capacity).items():
        if model in served:
            caps[keys.pool(served[model].value, model)] = max(0, min(capacity, int(cap)))
    return caps
