"""The network-fault tier: separate hosts on this machine (network namespaces on a bridge,
bench/netns.py) and half-open partitions made with iptables DROP. Needs root, ``ip`` and
``iptables`` (scripts/run_fault_tests.sh checks them first). Tests here carry the ``faults`` mark
and are collected only when ``-m`` names it (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.netns import missing_tools
from bench.partition import Lab, lab


@pytest.fixture
def partition_lab() -> Iterator[Lab]:
    """A fresh network with Redis in its own host (every namespace removed afterwards)."""
    missing = missing_tools()
    if missing:
        pytest.skip(f"the fault tier needs {', '.join(missing)} (scripts/run_fault_tests.sh)")
    with lab() as one:
        yield one
