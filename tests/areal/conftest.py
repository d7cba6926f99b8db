"""The AReaL tier (``pytest -m areal tests/areal``, run by scripts/run_areal_tests.sh in the AReaL
venv): AReaL's own rollout workflows through the fleet. Collected only when ``-m`` names ``areal``;
without areal installed every test here is skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

HAS_AREAL = importlib.util.find_spec("areal") is not None
requires_areal = pytest.mark.skipif(not HAS_AREAL, reason="areal is not installed; run scripts/run_areal_tests.sh")
# Third-party code (areal, ray, transformers, hydra) warns freely; the project's "warnings are
# errors" stays for everything else.
_THIRD_PARTY_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning",
                         "ResourceWarning", "RuntimeWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("areal") is not None:
            for category in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
