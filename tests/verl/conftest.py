"""The verl tier (``pytest -m verl tests/verl``, run by scripts/run_verl_tests.sh in the verl venv):
verl's own agent loops through the fleet. Collected only when ``-m`` names ``verl``; without verl
installed every test here is skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

from tests.third_party import tolerate_warnings

HAS_VERL = importlib.util.find_spec("verl") is not None
requires_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed; run scripts/run_verl_tests.sh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tolerate_warnings(items, "verl")
