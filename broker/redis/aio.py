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


class HeldFuture(asyncio.Future[T]):
    """A future that a cancellation of the task awaiting it does not cancel. ``Task.cancel()`` asks
    the future its task waits on to cancel, and this one declines, so the task's cancellation is
    delivered once the future is done (``outcome_of``) instead of cutting the wait short. Its owner
    still can: ``drop``. Instead of ``asyncio.shield`` (an outer future, two callbacks and one more
    event-loop turn): 4.9 against 8.2 µs a wait (``python -m bench.hot_path --size full``, the
    ``commit wait, cancellation held`` row)."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False  # the awaiting task was cancelled: it stays cancelled, and waits for the outcome

    def drop(self) -> bool:
        """Cancel it: the call it waits for will not be answered (its owner is closing)."""
        return super().cancel()


def drop(fut: asyncio.Future[Any]) -> bool:
    """Cancel ``fut``, a :class:`HeldFuture` too."""
    return fut.drop() if isinstance(fut, HeldFuture) else fut.cancel()


async def outcome_of(fut: HeldFuture[T]) -> T:
    """The outcome of ``fut``, which another task settles (a coalesced script call: Scripts), waited
    for even when this task is cancelled meanwhile. The cancellation is not lost: it is requested
    again once ``fut`` is done, so it stays counted (``Task.cancelling()``) and lands at this task's
    next await, or sooner at ``raise_if_cancelling`` (broker/redis/backoff.py). A dropped ``fut``
    raises at once."""
    try:
        return await fut
    except asyncio.CancelledError:
        if fut.cancelled() or not fut.done():
            raise
        task = asyncio.current_task()  # only on a cancellation: in Python 3.11 a getpid syscall
        if task is not None:  # the cancellation arrived with the outcome: requested again, for later
            task.uncancel()  # the count stays what the cancel() calls made it
            task.cancel()  # the task is running: its next await raises CancelledError
        return fut.result()
