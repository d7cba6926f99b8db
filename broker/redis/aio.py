"""Awaiting helpers: redis-py types some asyncio commands as ``Awaitable[T] | T`` (``resolve``
awaits them with a clean type), and ``settle`` hands a call's outcome to a future."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def resolve(value: Awaitable[T] | T) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


async def settle(fut: asyncio.Future[Any], call: Awaitable[Any]) -> None:
    """Await ``call`` and give its result or error to ``fut`` (unless it is done already)."""
    try:
        result = await call
    except Exception as exc:
        if not fut.done():
            fut.set_exception(exc)
        return
    if not fut.done():
        fut.set_result(result)
