"""Awaiting helpers: redis-py types some asyncio commands as ``Awaitable[T] | T`` (``resolve``
awaits them with a clean type), ``settle`` hands a call's outcome to a future, and ``outcome_of``
waits for one through a cancellation."""

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


async def outcome_of(fut: asyncio.Future[T]) -> T:
    """The outcome of ``fut``, which another task settles (a coalesced script call: Scripts), waited
    for even when this task is cancelled meanwhile. The cancellation is not lost: it is requested
    again once ``fut`` is done, so it stays counted (``Task.cancelling()``) and lands at this task's
    next await, or sooner at ``raise_if_cancelling`` (broker/redis/backoff.py). A cancelled ``fut``
    raises at once. No task of its own: ``asyncio.shield`` of a future is a future and two callbacks."""
    held = False
    try:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.cancelled():
                    raise
                held = True
        return fut.result()
    finally:
        task = asyncio.current_task() if held else None
        if task is not None:
            task.uncancel()  # the count stays what the cancel() calls made it
            task.cancel()  # the task is running: its next await raises CancelledError
