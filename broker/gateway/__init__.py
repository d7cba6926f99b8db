"""The vLLM-Omni-compatible HTTP rollout API in front of the fleet (needs the ``gateway`` extra)."""

from broker.gateway.app import DEFAULT_MODEL, create_app, serve

__all__ = ["DEFAULT_MODEL", "create_app", "serve"]
