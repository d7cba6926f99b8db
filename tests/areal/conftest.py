"""The AReaL tier (``pytest -m areal tests/areal``, run by scripts/run_areal_tests.sh in the AReaL
venv): AReaL's own rollout workflows through the fleet. Collected only when ``-m`` names ``areal``;
without areal installed every test here is skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

from tests.third_party import tolerate_warnings

HAS_AREAL = importlib.util.find_spec("areal") is not None
requires_areal = pytest.mark.skipif(not HAS_AREAL, reason="areal is not installed; run scripts/run_areal_tests.sh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tolerate_warnings(items, "areal", extra=("RuntimeWarning",))
