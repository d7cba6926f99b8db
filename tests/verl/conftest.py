"""The verl tier (``pytest -m verl tests/verl``, run by scripts/run_verl_tests.sh in the verl venv):
verl's own agent loops through the fleet. Collected only when ``-m`` names ``verl``; without verl
installed every test here is skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

HAS_VERL = importlib.util.find_spec("verl") is not None
requires_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed; run scripts/run_verl_tests.sh")
# Third-party code (verl, ray, transformers, hydra) warns freely; the project's "warnings are errors"
# stays for everything else.
_THIRD_PARTY_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning",
                         "ResourceWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("verl") is not None:
            for category in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
