"""dynamo.aio.next_now: take what an async iterator has ready without waiting, finish the rest later."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.aio import Pending, next_now


async def _from_queue(q: asyncio.Queue, log: list[str]):
    try:
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        log.append("closed")


async def test_ready_items_come_back_at_once_and_a_wait_becomes_pending():
    q: asyncio.Queue = asyncio.Queue()
    log: list[str] = []
    gen = _from_queue(q, log)
    q.put_nowait("a")
    q.put_nowait("b")
    assert next_now(gen) == "a"
    assert next_now(gen) == "b"
    pending = next_now(gen)
    assert type(pending) is Pending
    asyncio.get_running_loop().call_later(0.01, q.put_nowait, "c")
    assert await pending == "c"
    q.put_nowait(None)
    with pytest.raises(StopAsyncIteration):
        next_now(gen)
    assert log == ["closed"]


async def test_end_and_errors_arrive_through_the_pending_call():
    q: asyncio.Queue = asyncio.Queue()
    gen = _from_queue(q, [])
    pending = next_now(gen)
    q.put_nowait(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        await pending

    q2: asyncio.Queue = asyncio.Queue()
    gen2 = _from_queue(q2, [])
    pending = next_now(gen2)
    q2.put_nowait(None)
    with pytest.raises(StopAsyncIteration):
        await pending


async def test_cancelling_the_waiting_task_reaches_the_iterator():
    q: asyncio.Queue = asyncio.Queue()
    log: list[str] = []
    gen = _from_queue(q, log)

    async def consume() -> None:
        pending = next_now(gen)
        await pending

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["closed"]


async def test_abandon_lets_the_generator_close():
    q: asyncio.Queue = asyncio.Queue()
    log: list[str] = []
    gen = _from_queue(q, log)
    pending = next_now(gen)
    assert type(pending) is Pending
    await pending.abandon()
    await gen.aclose()  # would raise "already running" had the started call been left as it was
    assert log == ["closed"]


async def test_abandon_finishes_cleanup_that_awaits():
    log: list[str] = []

    async def slow_cleanup():
        try:
            await asyncio.sleep(10)
            yield 1
        finally:
            await asyncio.sleep(0.01)
            log.append("cleaned")

    gen = slow_cleanup()
    pending = next_now(gen)
    await pending.abandon()
    assert log == ["cleaned"]


async def test_works_on_plain_async_iterators_too():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def __aiter__(self):
            return self

        async def __anext__(self) -> int:
            self.n += 1
            if self.n % 2 == 0:
                await asyncio.sleep(0)
            if self.n > 4:
                raise StopAsyncIteration
            return self.n

    it = Counter()
    got = []
    while True:
        try:
            item = next_now(it)
            if type(item) is Pending:
                item = await item
        except StopAsyncIteration:
            break
        got.append(item)
    assert got == [1, 2, 3, 4]
