"""Trainer side: the async and sync fleet clients, reply streams and consumer groups."""

from broker.client.admission_wait import Admission
from broker.client.fleet import FleetClient
from broker.client.session import Session
from broker.client.sync import SyncFleetClient, SyncSession
from broker.redis.config import DEFAULT_URL, CellConfig

__all__ = ["DEFAULT_URL", "Admission", "CellConfig", "FleetClient", "Session", "SyncFleetClient", "SyncSession"]
