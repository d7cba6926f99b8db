"""The RLinf tier (``pytest -m rlinf tests/rlinf``, run by scripts/run_rlinf_tests.sh in the RLinf
venv): RLinf's own world-model env base class, env lookup and action preparation through the fleet.
Collected only when ``-m`` names ``rlinf``; without rlinf installed every test here is skipped with
the reason."""

from __future__ import annotations

import importlib.util

import pytest

HAS_RLINF = importlib.util.find_spec("rlinf") is not None
requires_rlinf = pytest.mark.skipif(not HAS_RLINF, reason="rlinf is not installed; run scripts/run_rlinf_tests.sh")
# Third-party code (rlinf, ray, omegaconf) warns freely; the project's "warnings are errors" stays
# for everything else.
_THIRD_PARTY_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning",
                         "ResourceWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("rlinf") is not None:
            for category in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
