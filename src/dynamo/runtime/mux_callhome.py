"""Multiplexed call-home, the worker side: one connection per client address carrying every stream
this worker sends there (wire format: :mod:`.mux`).

Writes of all streams during a loop turn leave together at its end (one ``send``); a heartbeat envelope
goes out when the connection had nothing to send for the heartbeat interval. Back-pressure is per
stream (the client's ``"pause"``/``"resume"``) and per connection (the socket's write buffer).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import orjson

from .codec import FrameError
from .context import Context
from .fleet_auth import FleetAuth, dial
from .mux import (
    END_OK,
    HEARTBEAT_ENVELOPE,
    WRITE_HIGH_WATER,
    EnvelopeDecoder,
    encode_mux_handshake,
    encode_plain_item,
    pack_envelope,
    split_frames,
)
from .tcp import CALL_HOME_TIMEOUT, split_address, tune_socket
from .transport import FRAME_PROLOGUE_OK, FRAME_SENTINEL, encode_prologue_error

log = logging.getLogger(__name__)

_loads = orjson.loads


class MuxConnection(asyncio.Protocol):
    """A worker's connection to one client address, carrying every stream it sends there.

    Writes of all streams during a loop turn leave together at its end (one ``send``); a heartbeat
    envelope goes out when the connection had nothing to send for the heartbeat interval.
    """

    def __init__(self, pool: "MuxPool", address: str) -> None:
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.sinks: dict[int, MuxSink] = {}
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.paused = False  # the socket's send buffer is full: every stream waits (drain)
        self._waiters: list[asyncio.Future] = []
        self._decoder = EnvelopeDecoder()
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self.heartbeat_s = 0.0
        self._wrote = False
        self._beat: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        tune_socket(transport)
        # the buffer a connection per stream had, for all streams together: a frontend a few turns
        # behind should not pause every stream at once (per-stream back-pressure is "pause"/"resume")
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            envelopes = self._decoder.feed(data)
            for sid, payload in envelopes:
                sink = self.sinks.get(sid)
                if sink is None:
                    continue  # finished already, or a heartbeat-level message we do not know
                for header, _body in split_frames(payload):
                    if header:
                        sink.on_control(_loads(header))
        except (FrameError, orjson.JSONDecodeError) as exc:
            log.warning("bad control frame from client %s: %s", self.address, exc)
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False  # close: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        self.pool.forget(self)
        for sink in list(self.sinks.values()):
            sink.lost()
        self.sinks.clear()
        self._wake(all_waiters=True)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake(all_waiters=True)

    # writing
    def send(self, stream_id: int, data: bytes) -> None:
        """Queue ``data`` (whole frames) for ``stream_id``; everything queued in a turn leaves in one write."""
        out = self._out
        out.append(pack_envelope(stream_id, len(data)))
        out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out:
            return
        data = b"".join(out)
        out.clear()
        self._wrote = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def start_heartbeats(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._beat = self._loop.call_later(heartbeat_s, self._heartbeat)

    def _heartbeat(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            self._beat = None
            return
        if self._wrote:
            self._wrote = False
        elif not self._out and not self.paused:
            transport.write(HEARTBEAT_ENVELOPE)
        self._beat = self._loop.call_later(self.heartbeat_s, self._heartbeat)

    async def wait_writable(self, sink: "MuxSink") -> None:
        while (self.paused or sink.paused) and not self.closed and not sink.finished:
            fut = self._loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass

    def _wake(self, all_waiters: bool = False) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(None)

    def open(self, stream_id: int, context: Context) -> "MuxSink":
        sink = MuxSink(self, stream_id, context)
        self.sinks[stream_id] = sink
        return sink

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


class MuxSink:
    """Worker end of one multiplexed stream (the interface of TcpSink, for runtime/ingress.py)."""

    __slots__ = ("conn", "stream_id", "context", "finished", "paused")

    def __init__(self, conn: MuxConnection, stream_id: int, context: Context) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.context = context
        self.finished = False
        self.paused = False  # the client asked us to hold this stream (its consumer is behind)

    encode_item = staticmethod(encode_plain_item)  # what the ingress pump encodes items with

    def write(self, frame: bytes) -> None:
        self.conn.send(self.stream_id, frame)

    queue = write  # everything leaves at the end of the turn anyway

    @property
    def must_drain(self) -> bool:
        return self.paused or self.conn.paused

    async def drain(self) -> None:
        await self.conn.wait_writable(self)

    def send_prologue(self, error: str | None = None) -> None:
        self.conn.send(self.stream_id, FRAME_PROLOGUE_OK if error is None else encode_prologue_error(error))

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.conn.send(self.stream_id, END_OK)
        self.conn.sinks.pop(self.stream_id, None)

    def abort(self) -> None:
        """End without the completion marker: the client reports an incomplete stream."""
        if self.finished:
            return
        self.finished = True
        self.conn.send(self.stream_id, FRAME_SENTINEL)
        self.conn.sinks.pop(self.stream_id, None)

    def on_control(self, ctl: Any) -> None:
        if ctl == "stop":
            self.context.stop_generating()
        elif ctl == "kill":
            self.context.kill()
        elif ctl == "pause":
            self.paused = True
        elif ctl == "resume":
            self.paused = False
            self.conn._wake()

    def lost(self) -> None:
        """The connection went: nobody reads what this stream would produce."""
        if not self.finished:
            self.finished = True
            self.context.kill()


class MuxPool:
    """A worker's multiplexed connections, one per client address (a DistributedRuntime owns one)."""

    def __init__(self, auth: FleetAuth | None = None) -> None:
        self.auth = auth  # the fleet secret's keys, proved to each client's listener first (None: none)
        self._conns: dict[str, MuxConnection] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    async def get(self, address: str, heartbeat_ms: int | None, timeout: float = CALL_HOME_TIMEOUT) -> MuxConnection:
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(address)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._connecting[address] = fut
        try:
            conn = await self._connect(address, heartbeat_ms, timeout)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: the waiters get it
            raise
        finally:
            self._connecting.pop(address, None)
        fut.set_result(conn)
        return conn

    async def _connect(self, address: str, heartbeat_ms: int | None, timeout: float) -> MuxConnection:
        host, port = split_address(address)
        conn = cast(MuxConnection, await dial(self.auth, address, host, port, lambda: MuxConnection(self, address),
                                              timeout, "response streams"))
        assert conn.transport is not None
        conn.transport.write(encode_mux_handshake(heartbeat_ms))
        if heartbeat_ms:
            conn.start_heartbeats(heartbeat_ms / 1000)
        self._conns[address] = conn
        log.info("response streams to %s share one multiplexed connection", address)
        return conn

    def forget(self, conn: MuxConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    def close(self) -> None:
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
