"""Multiplexed call-home: one TCP connection from a worker to a client process carries all its streams.

Why: with a connection per stream (the original's protocol, spec 7.4) every token costs one ``send`` on
the worker and one ``recv`` on the client per stream, and a new request costs a connect, an accept and a
handshake, each a loop turn behind every other stream's tokens. Over one connection a loop turn's tokens
of all streams leave in one ``send`` and arrive in one ``recv`` (docs/performance.md has the figures).

Negotiation (our addition; peers that do not know it keep the per-stream protocol): the client puts
``"mux_stream": <int id>`` in a request's connection info beside the usual ``subject``. A worker that
knows it sends the stream over its shared connection to that address; one that does not (the original
Rust binary, older builds of ours) ignores the key and calls home per stream with ``subject``. A client
that does not offer it (the original) gets per-stream connections from our workers.

Wire format on a multiplexed connection:
  worker -> client, once, first: an ordinary frame, header ``{"stream_type": "mux", "mux": 1,
      "heartbeat_ms": N}``
  then, both ways: envelopes: 16-byte prefix (stream id u64, length u64, big-endian) and ``length``
      bytes holding whole ordinary frames of that stream: the prologue, items, completion marker and
      ``"sentinel"`` (worker -> client; a sentinel without the completion marker is an aborted stream),
      ``"stop"``/``"kill"``/``"pause"``/``"resume"`` (client -> worker).  Stream id 0 is the
      connection itself: ``"heartbeat"`` frames while the connection is idle.  A plain item (not an
      ``Annotated``) travels as a frame with header ``"item"`` and the item's own JSON as its body, so
      a client can pass it on without decoding it (dynamo/lazyjson.py).

Liveness is per connection (heartbeats when idle; the client fails every stream of a connection that
was silent for the bound). Back-pressure is per stream: a client holding too many unread items of one
stream sends ``"pause"`` for it and ``"resume"`` when its consumer caught up, so one slow consumer never
stops the connection the other streams share. A stream's ``kill`` ends that stream only.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import TYPE_CHECKING, Any

import orjson

from .annotated import Annotated
from .codec import PREFIX_LEN, FrameError, encode_frame
from .context import Context
from .errors import EngineError, StreamStalledError
from .transport import (
    CONTROL_FRAMES,
    FRAME_COMPLETE,
    FRAME_HEARTBEAT,
    FRAME_PROLOGUE_OK,
    FRAME_SENTINEL,
    StreamState,
    encode_item,
    encode_prologue_error,
)

if TYPE_CHECKING:
    from .tcp import TcpResponseServer

log = logging.getLogger(__name__)

MUX_VERSION = 1
INFO_KEY = "mux_stream"  # connection-info key: the client accepts this stream multiplexed, under this id
_ENVELOPE = struct.Struct(">QQ")
ENVELOPE_LEN = _ENVELOPE.size  # 16
_pack_envelope = _ENVELOPE.pack
_unpack_envelope = _ENVELOPE.unpack_from
_unpack_prefix = struct.Struct(">QQQ").unpack_from
_loads = orjson.loads
MAX_ENVELOPE = 256 * 1024 * 1024
WRITE_HIGH_WATER = 4 * 1024 * 1024  # a worker's bytes waiting for the kernel before its streams pause

FRAME_PAUSE = encode_frame(header=b'"pause"')
FRAME_RESUME = encode_frame(header=b'"resume"')
_CLIENT_CONTROL = {**CONTROL_FRAMES, "pause": FRAME_PAUSE, "resume": FRAME_RESUME}
_HEARTBEAT_ENVELOPE = _pack_envelope(0, len(FRAME_HEARTBEAT)) + FRAME_HEARTBEAT
ITEM_HEADER = b'"item"'  # a plain item, its JSON as the body: no Annotated wrapping to decode
_ITEM_HEADER_LEN = len(ITEM_HEADER)
_pack_prefix = struct.Struct(">QQQ").pack
_dumps = orjson.dumps


def encode_plain_item(item: Any) -> bytes:
    """A stream item as a multiplexed connection carries it: an ``"item"`` frame whose body is the
    item's JSON (Annotated items, errors included, keep the ordinary frame)."""
    if isinstance(item, Annotated):
        return encode_item(item)
    body = _dumps(item)
    return _pack_prefix(_ITEM_HEADER_LEN, len(body), 0) + ITEM_HEADER + body
_END_OK = FRAME_COMPLETE + FRAME_SENTINEL


def envelope(stream_id: int, data: bytes) -> bytes:
    """One envelope: ``data`` (whole frames of stream ``stream_id``) behind its 16-byte prefix."""
    return _pack_envelope(stream_id, len(data)) + data


def encode_mux_handshake(heartbeat_ms: int | None) -> bytes:
    ctl: dict[str, Any] = {"stream_type": "mux", "mux": MUX_VERSION}
    if heartbeat_ms:
        ctl["heartbeat_ms"] = heartbeat_ms
    return encode_frame(header=orjson.dumps(ctl))


def is_mux_handshake(ctl: Any) -> bool:
    return isinstance(ctl, dict) and ctl.get("stream_type") == "mux"


class EnvelopeDecoder:
    """Incremental decoder of envelopes: ``feed(bytes)`` -> [(stream id, payload)] now complete."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:
            src = data
        out: list[tuple[int, bytes]] = []
        pos = 0
        size = len(src)
        while size - pos >= ENVELOPE_LEN:
            sid, length = _unpack_envelope(src, pos)
            if length > MAX_ENVELOPE:
                raise FrameError("envelope too large")
            start = pos + ENVELOPE_LEN
            end = start + length
            if end > size:
                break
            out.append((sid, bytes(src[start:end])))
            pos = end
        if src is buf:
            if pos:
                del buf[:pos]
        elif pos < size:
            buf += data[pos:]
        return out


def split_frames(payload: bytes) -> list[tuple[bytes, bytes]]:
    """The whole frames an envelope carries, as (header, body)."""
    frames = []
    pos = 0
    size = len(payload)
    while pos < size:
        if size - pos < PREFIX_LEN:
            raise FrameError("envelope ends inside a frame prefix")
        header_len, body_len, _check = _unpack_prefix(payload, pos)
        start = pos + PREFIX_LEN
        mid = start + header_len
        end = mid + body_len
        if end > size:
            raise FrameError("envelope ends inside a frame")
        frames.append((payload[start:mid], payload[mid:end]))
        pos = end
    return frames


# ---------------------------------------------------------------------------------- client side


class MuxClientProtocol(asyncio.Protocol):
    """The client's end of one worker's multiplexed connection: demultiplexes to each StreamState.

    Installed on the transport by the call-home listener once it has read the mux handshake.
    """

    def __init__(self, server: "TcpResponseServer", transport: asyncio.Transport) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = transport
        self._buf = bytearray()  # the start of an envelope whose end has not arrived yet
        # stream id -> its state; None: a stream we do not serve (withdrawn, killed) whose frames are
        # dropped until its sentinel
        self.streams: dict[int, StreamState | None] = {}
        self.quiet = 0  # liveness ticks since the worker last sent anything

    def data_received(self, data: bytes) -> None:
        """Every whole envelope of the read goes to its stream's buffer; each stream touched is woken once.

        The per-token path of a frontend: frames are parsed in place (no intermediate lists)."""
        transport = self.transport
        if transport is None:
            return
        self.quiet = 0
        buf = self._buf
        if buf:
            buf += data
            src: bytes = bytes(buf)
            buf.clear()
        else:
            src = data
        size = len(src)
        pos = 0
        streams = self.streams
        touched: dict[int, StreamState] = {}
        unpack_env = _unpack_envelope
        unpack = _unpack_prefix
        loads = _loads
        try:
            while size - pos >= ENVELOPE_LEN:
                sid, length = unpack_env(src, pos)
                if length > MAX_ENVELOPE:
                    raise FrameError("envelope too large")
                start = pos + ENVELOPE_LEN
                end = start + length
                if end > size:
                    break
                pos = end
                if not sid:
                    continue  # a heartbeat: the connection is alive (quiet was reset above)
                state = streams[sid] if sid in streams else self._attach(sid)
                if state is None or state.finished:
                    if _has_sentinel(src[start:end]):
                        streams.pop(sid, None)  # its last frame: forget it
                    continue
                items = state.items
                p = start
                while p < end:
                    header_len, body_len, _check = unpack(src, p)
                    h = p + PREFIX_LEN
                    b = h + header_len
                    p = b + body_len
                    if p > end:
                        raise FrameError("envelope ends inside a frame")
                    if header_len == _ITEM_HEADER_LEN and body_len:  # "item": a plain item's JSON
                        if not state.finished:
                            items.append(src[b:p])  # bytes: the consumer decodes it (dynamo/lazyjson.py)
                    elif body_len:
                        msg = loads(src[b:p])
                        ann = msg.get("data")
                        if ann is not None:
                            if not state.finished:  # e.g. after a prologue error: nothing more is its
                                items.append(ann)
                        elif msg.get("complete_final"):
                            state.complete()
                        else:
                            state.fail(EngineError("Empty response received - this should never happen"))
                    elif header_len:
                        ctl = loads(src[h:b])
                        if ctl == "sentinel":
                            streams.pop(sid, None)
                            if not state.finished:
                                state.fail_incomplete()  # ended without its completion marker: aborted
                        elif isinstance(ctl, dict) and ctl.get("error"):
                            state.fail(EngineError(str(ctl["error"])))
                touched[sid] = state
        except (FrameError, struct.error, orjson.JSONDecodeError) as exc:
            log.warning("bad envelope from worker: %s", exc)
            transport.close()
            return
        if pos < size:
            buf += src[pos:]
        high = StreamState.HIGH_WATER
        for sid, state in touched.items():
            if len(state.items) > high and not state.finished and not state.paused:
                state.pause(_Control(self, sid, "pause"), _Control(self, sid, "resume"))
            state.wake()

    def _attach(self, sid: int) -> StreamState | None:
        state = self.server.take_mux(sid)
        if state is None or state.finished:
            # withdrawn (not acked in time) or never ours: stop its handler, drop what is on its way
            self.streams[sid] = None
            self._write(sid, "kill")
            return None
        self.streams[sid] = state
        state.attach(_Control(self, sid, None))
        return state

    def _write(self, sid: int, kind: str) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            frame = _CLIENT_CONTROL[kind]
            transport.write(_pack_envelope(sid, len(frame)) + frame)

    def send_control(self, sid: int, kind: str) -> None:
        """stop/kill/pause/resume for one stream; the connection and the other streams carry on."""
        self._write(sid, kind)

    def stalled(self) -> None:
        """Silent for the liveness bound: every stream fails as a frozen worker's; the connection goes."""
        for state in list(self.streams.values()):
            if state is not None and not state.finished:
                state.fail(StreamStalledError())
        self.streams.clear()
        if self.transport is not None:
            self.transport.close()  # a worker that wakes up sees it closed and cancels its handlers

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.mux_connections.discard(self)
        for state in list(self.streams.values()):
            if state is not None and not state.finished:
                state.fail_incomplete()
        self.streams.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _has_sentinel(payload: bytes) -> bool:
    try:
        frames = split_frames(payload)
    except FrameError:
        return False
    return any(h == b'"sentinel"' for h, _ in frames)


class _Control:
    """``sender(kind)`` for one multiplexed stream (StreamState.attach / pause callbacks)."""

    __slots__ = ("conn", "sid", "fixed")

    def __init__(self, conn: MuxClientProtocol, sid: int, fixed: str | None) -> None:
        self.conn = conn
        self.sid = sid
        self.fixed = fixed

    def __call__(self, kind: str | None = None) -> None:
        self.conn.send_control(self.sid, self.fixed or kind or "kill")


# ---------------------------------------------------------------------------------- worker side


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
        from .tcp import _nodelay

        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)
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
        out.append(_pack_envelope(stream_id, len(data)))
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
            transport.write(_HEARTBEAT_ENVELOPE)
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
        self.conn.send(self.stream_id, _END_OK)
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

    def __init__(self) -> None:
        self._conns: dict[str, MuxConnection] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    async def get(self, address: str, heartbeat_ms: int | None, timeout: float = 10.0) -> MuxConnection:
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
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: MuxConnection(self, address), host,
                                                                int(port)), timeout)
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

