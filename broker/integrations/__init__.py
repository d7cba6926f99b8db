"""Adapters that put trainer frameworks on the fleet: vime (multi-turn token rollouts), verl's agent
loops and RLinf's world-model env. Each imports nothing heavier than the trainer client; the
framework itself (verl, rlinf) and torch are imported only when their classes are used."""
