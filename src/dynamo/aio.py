"""Small asyncio helpers shared across the package."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Generator, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: "asyncio.Task[object] | None") -> None:
    """Cancel a background task and wait until it has really ended, ignoring how it ended.

    Used on close paths, where the task's own failure has already been logged and must not stop the
    rest of the shutdown.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


class Pending:
    """The rest of an ``__anext__()`` call that :func:`next_now` started and that had to wait.

    ``await pending`` finishes that same call (exactly as ``await it.__anext__()`` would have): the item,
    ``StopAsyncIteration``, or the iterator's exception.  Await it once, or call :meth:`abandon` when
    the item is no longer wanted: an async generator whose ``__anext__`` was started and never finished
    stays "running" and refuses ``aclose()``.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Any, first: Any) -> None:
        self._coro = coro
        self._first = first  # what the call yielded to the event loop when it suspended

    def __await__(self) -> Generator[Any, Any, Any]:
        # ``yield from coro`` for a coroutine that has already yielded once: hand its first yield to the
        # task, then relay sends and throws both ways until it returns.
        coro, value = self._coro, self._first
        self._first = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - cancellation included: relayed, not handled
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value

    async def abandon(self) -> None:
        """End the call as a cancelled ``await`` would (the iterator cleans up), ignoring the outcome."""
        coro = self._coro
        try:
            value = coro.throw(asyncio.CancelledError())
        except (StopIteration, StopAsyncIteration, asyncio.CancelledError, Exception):
            return
        self._first = value  # it awaits while cleaning up: finish driving it
        try:
            await self
        except (StopAsyncIteration, asyncio.CancelledError, Exception):
            pass


def next_now(it: AsyncIterator[T]) -> "T | Pending":
    """The next item of ``it`` if it is ready without waiting, else a :class:`Pending` to await.

    Lets a writer gather every item that is already there and send them together, without ever
    holding back an item to wait for another: a stream that is behind catches up with one write per
    batch instead of one per item.  Raises ``StopAsyncIteration`` (or the iterator's error) at once
    when that is what ``__anext__`` does without waiting.
    """
    coro = it.__anext__().__await__()  # a coroutine's wrapper, or the async generator's asend object
    try:
        first = coro.send(None)
    except StopIteration as stop:
        return stop.value
    return Pending(coro, first)
