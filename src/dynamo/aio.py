"""Small asyncio helpers shared across the package."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl as ssl_module
import types
from typing import Any, AsyncIterator, Callable, Generator, TypeVar, cast

log = logging.getLogger(__name__)
ACCEPT_RETRY_S = 1.0  # pause after a failed accept (out of file descriptors) before accepting again

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


@types.coroutine
def finish(call: Any, signal: Any) -> Generator[Any, Any, Any]:
    """``await finish(call, signal)``: the rest of an ``__anext__()`` call started by hand.

    ``call`` is the object ``__anext__()`` returned, already sent ``None`` once, and ``signal`` what
    it yielded to the event loop when it had to wait.  Finishing it hands ``signal`` to the task and
    relays sends and throws both ways, exactly as ``await it.__anext__()`` would have, so the
    iterator sees cancellation (``asyncio.timeout`` included) and failed futures as under a task.
    The result is the item; ``StopAsyncIteration`` or the iterator's error is raised.  Once awaited,
    the call is over however the await ends (closing the awaiting coroutine closes the call).

    A writer that starts each call itself sees whether the item is ready without waiting for it
    (:func:`next_now` does that with a :class:`Pending`; the streaming pumps inline the start).
    """
    while True:
        try:
            sent = yield signal
        except GeneratorExit:
            call.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - cancellation included: relayed, not handled
            try:
                signal = call.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                signal = call.send(sent)
            except StopIteration as stop:
                return stop.value


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
        coro, value = self._coro, self._first
        self._first = None
        return (yield from finish(coro, value))

    async def abandon(self) -> None:
        """End the call as a cancelled ``await`` would (the iterator cleans up), ignoring the outcome."""
        await abandon(self._coro)


async def abandon(call: Any) -> None:
    """End a started ``__anext__()`` call that is still waiting, as a cancelled ``await`` would (the
    iterator cleans up), ignoring the outcome."""
    try:
        value = call.throw(asyncio.CancelledError())
    except (StopIteration, StopAsyncIteration, asyncio.CancelledError, Exception):
        return
    try:  # it awaits while cleaning up: finish driving it
        await finish(call, value)
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


async def _finish(pending: Pending) -> Any:
    return await pending


class Acceptor:
    """Serve a listening socket, accepting every connection that is waiting each time it is readable.

    Why not ``loop.create_server``: uvloop accepts one connection per turn of the event loop.  When
    the loop is busy (hundreds of streams, a turn taking tens of milliseconds) a burst of new
    connections then queues in the kernel, one more each turn: measured with 256 streams, the last
    workers' call-home connections waited 2 s to be accepted, and so did their first tokens
    (docs/performance.md).  The transports and protocols are the loop's own
    (``connect_accepted_socket``); only the accepting is ours.
    """

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.BaseProtocol],
                 *, per_turn: int = 1024, ssl: "ssl_module.SSLContext | None" = None,
                 ssl_handshake_timeout: float | None = None,
                 on_failure: Callable[[Any, BaseException], None] | None = None) -> None:
        self.sock = sock
        self._factory = protocol_factory
        self._ssl = ssl  # TLS (HTTPS, the TCP planes): the loop's TLS transport does the handshake
        self._handshake_timeout = ssl_handshake_timeout if ssl is not None else None
        # a connection that failed to start (a failed TLS handshake), with the peer's address: the loop
        # itself says nothing of it
        self._on_failure = on_failure
        self._per_turn = per_turn
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        loop = self._loop
        for _ in range(self._per_turn):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: pause, as asyncio's own server does
                log.warning("accept failed on %s: %s; retrying in %gs", self.sock.getsockname(), exc,
                            ACCEPT_RETRY_S)
                fd = self.sock.fileno()
                loop.remove_reader(fd)
                loop.call_later(ACCEPT_RETRY_S, self._resume, fd)
                return
            conn.setblocking(False)
            # Its first step sets the transport up and starts reading, now rather than a turn later;
            # what is left (waiting for connection_made) runs as a task.
            if self._handshake_timeout is None:
                coro = loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl)
            else:
                coro = loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl,
                                                    ssl_handshake_timeout=self._handshake_timeout)
            try:
                first = coro.send(None)
            except StopIteration:
                continue
            except Exception as exc:  # noqa: BLE001 - one bad connection must not stop the others
                log.debug("accepted connection failed to start: %s", exc)
                conn.close()
                continue
            task = loop.create_task(_finish(Pending(coro, first)))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._accepted, peer=addr))

    def _resume(self, fd: int) -> None:
        if self.sock.fileno() == fd:  # not closed meanwhile
            self._loop.add_reader(fd, self._on_readable)

    def _accepted(self, task: "asyncio.Task[Any]", peer: Any) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self._on_failure is not None:
            self._on_failure(peer, cast(BaseException, task.exception()))
        else:
            log.debug("accepted connection failed to start: %s", task.exception())

    def close(self) -> None:
        """Stop accepting (connections already accepted are left alone)."""
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
