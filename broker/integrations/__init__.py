"""Adapters that put trainer frameworks on the fleet: vime (multi-turn token rollouts), verl's agent
loops, AReaL's rollout workflows and RLinf's world-model env. Each imports nothing heavier than the
trainer client; the framework itself (verl, areal, rlinf) and torch are imported only when their
classes are used."""
