"""The RLinf tier (``pytest -m rlinf tests/rlinf``, run by scripts/run_rlinf_tests.sh in the RLinf
venv): RLinf's own world-model env base class, env lookup and action preparation through the fleet.
Collected only when ``-m`` names ``rlinf``; without rlinf installed every test here is skipped with
the reason."""

from __future__ import annotations

import importlib.util

import pytest

from tests.third_party import tolerate_warnings

HAS_RLINF = importlib.util.find_spec("rlinf") is not None
requires_rlinf = pytest.mark.skipif(not HAS_RLINF, reason="rlinf is not installed; run scripts/run_rlinf_tests.sh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tolerate_warnings(items, "rlinf")
