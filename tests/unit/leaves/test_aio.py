"""dynamo.aio.next_now: take what an async iterator has ready without waiting, finish the rest later."""

from __future__ import annotations

import asyncio
from typing import Any

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


def _burst_accepted_turns(use_acceptor: bool) -> list[int]:
    """30 connections wait in the kernel's queue for a loop whose every turn is busy: the turn each
    was accepted in."""
    import socket
    import time

    import uvloop

    from dynamo.aio import Acceptor

    turns = [0]
    accepted: list[int] = []

    sock = socket.create_server(("127.0.0.1", 0), backlog=128)
    clients = [socket.create_connection(sock.getsockname()) for _ in range(30)]  # queued, not accepted

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()  # all 30 accepted, or 500 turns went by (the assertion below then fails)

        class Recorder(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
                accepted.append(turns[0])
                if len(accepted) == 30:
                    done.set()

        if use_acceptor:
            server: Any = Acceptor(sock, Recorder)
        else:
            server = await loop.create_server(Recorder, sock=sock)

        def busy() -> None:  # every turn of the loop does 2 ms of other work
            turns[0] += 1
            time.sleep(0.002)
            if turns[0] >= 500:
                done.set()
            loop.call_soon(busy)

        loop.call_soon(busy)
        await done.wait()
        server.close()

    try:
        uvloop.run(main())
    finally:
        for c in clients:
            c.close()
    assert len(accepted) == 30
    return accepted


def test_acceptor_takes_a_burst_of_connections_in_one_turn():
    # the loop's own server (uvloop) takes one connection per turn: what Acceptor is for
    own = _burst_accepted_turns(use_acceptor=False)
    ours = _burst_accepted_turns(use_acceptor=True)
    assert own[-1] - own[0] >= 20
    assert ours[-1] - ours[0] <= 1


async def test_acceptor_close_stops_accepting():
    import socket

    from dynamo.aio import Acceptor

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    got: list[asyncio.Transport] = []
    accepted = asyncio.Event()

    class Keep(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            got.append(transport)  # type: ignore[arg-type]
            accepted.set()

    acceptor = Acceptor(sock, Keep)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.wait_for(accepted.wait(), 10)
    acceptor.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    got[0].write(b"still served")
    assert await reader.readexactly(12) == b"still served"
    writer.close()
    got[0].close()


async def test_acceptor_pauses_after_a_failed_accept_and_resumes(monkeypatch: pytest.MonkeyPatch):
    import socket

    from dynamo import aio

    monkeypatch.setattr(aio, "ACCEPT_RETRY_S", 0.05)
    sock = socket.create_server(("127.0.0.1", 0))
    got: list[asyncio.BaseTransport] = []

    class Keep(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            got.append(transport)

    class Flaky:
        """The listening socket, whose accept fails once as if the process were out of descriptors."""

        def __init__(self, real: socket.socket) -> None:
            self.real = real
            self.calls = 0

        def accept(self):
            self.calls += 1
            if self.calls == 1:
                raise OSError(24, "Too many open files")
            return self.real.accept()

        def __getattr__(self, name: str):
            return getattr(self.real, name)

    flaky = Flaky(sock)
    acceptor = aio.Acceptor(flaky, Keep)  # type: ignore[arg-type]
    reader, writer = await asyncio.open_connection(*sock.getsockname())
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got, "the connection was never accepted after the failed accept"
    assert flaky.calls <= 4  # paused after the failure instead of retrying every loop turn
    acceptor.close()
    writer.close()
    got[0].close()


async def test_finish_relays_a_class_based_iterator_whose_anext_returns_a_future():
    from dynamo.aio import finish

    class Ticks:
        """``__anext__`` returns a bare future, not a coroutine."""

        def __init__(self) -> None:
            self.n = 0

        def __aiter__(self) -> "Ticks":
            return self

        def __anext__(self) -> "asyncio.Future[int]":
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[int] = loop.create_future()
            self.n += 1
            if self.n > 3:
                fut.set_exception(StopAsyncIteration())
            else:
                loop.call_later(0.001, fut.set_result, self.n)
            return fut

    it = Ticks()
    got = []
    while True:
        call = it.__anext__().__await__()
        try:
            signal = call.send(None)
        except StopIteration as done:
            got.append(done.value)
            continue
        except StopAsyncIteration:
            break
        try:
            got.append(await finish(call, signal))
        except StopAsyncIteration:
            break
    assert got == [1, 2, 3]
