"""Adapters that put trainer frameworks on the fleet: vime (multi-turn token rollouts), verl agent
loops, AReaL workflows and an RLinf-style world-model backend. Each imports nothing heavier than the
trainer client."""
