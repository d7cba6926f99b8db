"""Trainer side: the async and sync fleet clients, reply streams and consumer groups."""

from broker.client.fleet import DEFAULT_URL, FleetClient, Session
from broker.client.sync import SyncFleetClient, SyncSession

__all__ = ["DEFAULT_URL", "FleetClient", "Session", "SyncFleetClient", "SyncSession"]
