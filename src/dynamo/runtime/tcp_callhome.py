"""TCP call-home, the worker side: for each request it accepted, the worker dials the client's listener
and writes the response stream to it (:mod:`.tcp_listener` is the other end).

Writes: the handshake and prologue leave together at the end of the turn they are written in; item
frames leave at once, one write per batch of items the handler had ready (runtime/ingress.py). A
stream that had nothing to send for its heartbeat interval gets a ``"heartbeat"`` frame from one
periodic task per event loop, so a token costs one flag store.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import cast

import orjson

from .codec import FrameDecoder, FrameError
from .context import Context
from .fleet_auth import FleetAuth, dial
from .tcp import CALL_HOME_TIMEOUT, TRANSPORT_NAME, split_address, tune_socket
from .transport import (
    FRAME_COMPLETE,
    FRAME_HEARTBEAT,
    FRAME_PROLOGUE_OK,
    FRAME_SENTINEL,
    TurnBatch,
    encode_handshake,
    encode_prologue_error,
)
from .v1_wire import FRAME_COMPLETE_MSGPACK, encode_msgpack_item

_loads = orjson.loads


async def open_tcp_sink(transport: str, info: dict, context: Context, auth: FleetAuth | None = None) -> "TcpSink":
    """A per-stream call-home for a request whose connection info names this transport (``auth``: the
    fleet secret's keys, proved to the client's listener first)."""
    if transport != TRANSPORT_NAME:
        raise ValueError(f"unsupported response transport {transport!r}")
    return await TcpSink.connect(info, context, auth=auth)


class TcpSink(asyncio.Protocol):
    """Worker end of one call-home stream: buffered, coalesced writes; stop/kill from the client."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.transport: asyncio.Transport | None = None
        self._batch = TurnBatch(self._send)  # the handshake and prologue: they leave together
        self._paused = False
        self._drain: asyncio.Future | None = None
        self._decoder = FrameDecoder()
        self.finished = False
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self.heartbeat_s = 0.0
        self.wrote = False  # something left since the heartbeat ticker last looked
        self._complete = FRAME_COMPLETE

    def use_msgpack(self) -> None:
        """Data frames' bodies in msgpack from now on: the client is a Dynamo 1.x process that sent its
        request in msgpack (runtime/v1_wire.py); the handshake, prologue and sentinel stay JSON headers."""
        self.encode_item = encode_msgpack_item  # the ingress pump encodes items with the sink's own
        self._complete = FRAME_COMPLETE_MSGPACK

    @classmethod
    async def connect(cls, info: dict, context: Context, timeout: float = CALL_HOME_TIMEOUT,
                      auth: FleetAuth | None = None) -> "TcpSink":
        address = str(info["address"])
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        sink = cast(TcpSink, await dial(auth, address, host, port, lambda: cls(context), timeout, "response streams"))
        heartbeat_ms = info.get("heartbeat_ms")
        if isinstance(heartbeat_ms, int) and heartbeat_ms > 0 and not sink.closed:
            sink.heartbeat_s = heartbeat_ms / 1000
            sink.queue(encode_handshake(str(info["subject"]), heartbeat_ms))  # leaves with the prologue
            _HeartbeatTicker.for_loop(loop).add(sink)
        else:
            sink.queue(encode_handshake(str(info["subject"])))  # leaves with the prologue
        return sink

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        tune_socket(transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except FrameError:
            self.context.kill()
            return
        for header, _body in frames:
            if header:
                ctl = _loads(header)
                if ctl == "stop":
                    self.context.stop_generating()
                elif ctl == "kill":
                    self.context.kill()

    def eof_received(self) -> bool:
        if not self.finished:
            self.context.kill()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.heartbeat_s:
            _HeartbeatTicker.for_loop(self._loop).discard(self)
        if not self.finished:
            self.context.kill()  # the client went away: nobody reads what we would produce
        self._wake_drain()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # writing
    def write(self, frame: bytes) -> None:
        """Send now, or after what is still queued.  (The ingress pump joins the frames of the items
        a handler has ready into one write, so a write per loop turn and stream is the norm.)"""
        self.wrote = True
        if self._batch.frames:
            self._batch.queue(frame)
            return
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(frame)

    def queue(self, frame: bytes) -> None:
        """Send at the end of this loop turn, together with whatever else is written until then."""
        self._batch.queue(frame)

    def _send(self, data: bytes) -> None:
        self.wrote = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    @property
    def must_drain(self) -> bool:
        return self._paused

    async def drain(self) -> None:
        """Wait while the socket's buffer is over its high-water mark (backpressure)."""
        while self._paused and not self.closed:
            self._drain = self._loop.create_future()
            await self._drain
        self._drain = None

    def send_prologue(self, error: str | None = None) -> None:
        self.queue(FRAME_PROLOGUE_OK if error is None else encode_prologue_error(error))

    def finish(self) -> None:
        """Completion marker + sentinel, flush, close our side."""
        if self.finished:
            return
        self.finished = True
        self._batch.flush(self._complete, FRAME_SENTINEL)
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close without the completion marker (the client then reports an incomplete stream)."""
        self.finished = True
        self._batch.flush()
        if self.transport is not None:
            self.transport.close()


class _HeartbeatTicker:
    """One per event loop on a worker: a ``"heartbeat"`` frame on each stream that sent nothing for its
    heartbeat interval. One periodic task for all streams, so a token costs one flag store."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _HeartbeatTicker]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.sinks: set[TcpSink] = set()
        self.task: asyncio.Task | None = None

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "_HeartbeatTicker":
        ticker = cls._by_loop.get(loop)
        if ticker is None:
            ticker = cls._by_loop[loop] = cls()  # holds no reference to the loop: the entry goes with it
        return ticker

    def add(self, sink: TcpSink) -> None:
        self.sinks.add(sink)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="tcp-stream-heartbeats")

    def discard(self, sink: TcpSink) -> None:
        self.sinks.discard(sink)

    async def _run(self) -> None:
        try:
            while self.sinks:
                await asyncio.sleep(min(s.heartbeat_s for s in self.sinks))
                for sink in list(self.sinks):
                    transport = sink.transport
                    if sink.finished or transport is None or transport.is_closing():
                        self.sinks.discard(sink)
                    elif sink.wrote:
                        sink.wrote = False
                    elif not sink._batch.frames and not sink._paused:
                        transport.write(FRAME_HEARTBEAT)  # direct: the next tick still sees the stream idle
        finally:
            self.task = None
