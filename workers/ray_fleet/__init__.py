"""The fleet's workers on Ray: one worker process per Ray actor, its GPUs reserved by a placement
group, the actors placed, scaled and drained by a named, detached controller actor.

Ray is imported lazily (inside the functions that use it): importing this package needs no Ray.
See docs/deploy/ray.md.
"""

from workers.ray_fleet.autoscale import Autoscale
from workers.ray_fleet.fleet import FleetReport, RayFleet, RayFleetError, live_in_cell, wait_live
from workers.ray_fleet.spec import DEFAULT_NAME, NAMESPACE, FleetSpec, Placement, worker_env

__all__ = ["DEFAULT_NAME", "NAMESPACE", "Autoscale", "FleetReport", "FleetSpec", "Placement", "RayFleet",
           "RayFleetError", "live_in_cell", "wait_live", "worker_env"]
