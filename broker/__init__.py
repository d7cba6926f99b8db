"""Redis side of the fleet: key layout, Lua scripts, trainer clients."""

from broker.client import DEFAULT_URL, FleetClient, Session
from broker.sync_client import SyncFleetClient, SyncSession

__all__ = ["DEFAULT_URL", "FleetClient", "Session", "SyncFleetClient", "SyncSession"]
