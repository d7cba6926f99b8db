"""Fixtures: a private real Redis server per test session, a random key prefix per test."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from broker import FleetClient
from broker.redis.embedded import RedisServer, running_redis
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts
from tests.support import WorkerPool, worker_pool


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """Tests that run the CLI in-process configure the root logger with a handler on the stderr
    pytest captured for that test; left behind, it writes to a closed stream in later tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# Tiers collected only when -m names their mark: the cluster tier (tests/cluster/) starts a 6-node
# Redis Cluster; the verl tier (tests/verl/) needs the verl venv (scripts/run_verl_tests.sh); the
# RLinf tier (tests/rlinf/) needs the RLinf venv (scripts/run_rlinf_tests.sh).
# AReaL tier (tests/areal/) needs the AReaL venv (scripts/run_areal_tests.sh). The compose tier
# (tests/compose/) runs docker-compose.yml on a Docker engine (scripts/run_compose_tests.sh); the fault
# tier (tests/faults/) needs root for its network namespaces (scripts/run_fault_tests.sh); the Ray tier
# (tests/ray/) starts a local multi-node Ray cluster and needs the Ray venv (scripts/run_ray_tests.sh).
OPT_IN_MARKS = ("cluster", "verl", "rlinf", "areal", "compose", "faults", "ray")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Items of an opt-in tier run only when ``-m`` names its mark (``-m cluster``, ``-m verl``),
    never in the fast (``-m "not slow"``) or slow tier."""
    named = config.getoption("markexpr") or ""
    left_out = [mark for mark in OPT_IN_MARKS if mark not in named]
    skipped = [item for item in items if any(item.get_closest_marker(mark) is not None for mark in left_out)]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item not in skipped]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def fleet(redis_server: RedisServer, prefix: str) -> AsyncIterator[FleetClient]:
    async with FleetClient(redis_server.url, prefix=prefix) as client:
        yield client


@pytest.fixture
async def workers(redis_server: RedisServer, prefix: str) -> AsyncIterator[WorkerPool]:
    async with worker_pool(redis_server.url, prefix) as pool:
        yield pool


@pytest.fixture
async def scripts(redis_server: RedisServer, prefix: str) -> AsyncIterator[Scripts]:
    """The cell's Lua scripts on their own connection, for tests that call them directly."""
    redis = Redis.from_url(redis_server.url)
    scripts = Scripts(redis, CellKeys(prefix))
    yield scripts
    await scripts.cancel_pending()  # coalesced calls still in flight would reopen a connection
    await redis.aclose()
