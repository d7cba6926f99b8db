"""redis-py types some asyncio commands as ``Awaitable[T] | T``; this awaits them with a clean type."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def resolve(value: Awaitable[T] | T) -> T:
    if inspect.isawaitable(value):
        return await value
    return value
