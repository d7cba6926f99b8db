"""Redis side of the fleet: the Redis layer (``broker.redis``), the trainer clients
(``broker.client``), operations (``broker.ops``), rollout drivers (``broker.rollouts``), trainer
integrations (``broker.integrations``) and the HTTP gateway (``broker.gateway``)."""

from broker.client import DEFAULT_URL, FleetClient, Session, SyncFleetClient, SyncSession

__all__ = ["DEFAULT_URL", "FleetClient", "Session", "SyncFleetClient", "SyncSession"]
