"""The trainer API page's example (docs/trainer-api.md) runs as written against a real fleet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from broker.redis.embedded import RedisServer
from tests.support import WorkerPool
from workers.engines.reference import ReferenceEngine

PAGE = Path(__file__).resolve().parent.parent / "docs" / "trainer-api.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "docs/trainer-api.md has no python example"
    return blocks[0]


@pytest.mark.asyncio
async def test_readme_example(redis_server: RedisServer, workers: WorkerPool) -> None:
    await workers.add(ReferenceEngine(), prefix="rf")
    namespace: dict[str, Any] = {}
    exec(compile(_example(), "docs/trainer-api.md", "exec"), namespace)
    await namespace["main"](redis_server.url)
