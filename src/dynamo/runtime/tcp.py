"""TCP call-home response streams (spec 7.4), the default response transport.

The client process runs one TCP listener. Each request names a fresh stream key; the worker connects
back, sends a handshake with that key, then the prologue, the items, the completion marker and a
sentinel. The socket doubles as the liveness signal (a dead worker closes it, so the client knows at
once) and as the channel for the client's ``stop``/``kill``. Why TCP rather than NATS for the response
leg: docs/runtime.md ("Transport").

A frozen worker (SIGSTOP, a stalled host) closes nothing, so the client also asks for heartbeats
(``heartbeat_ms`` in the connection info): the worker sends a ``"heartbeat"`` frame on a stream that had
nothing to send for that long, and the client fails a stream that was silent for its liveness bound
(:class:`StreamStalledError`). Both sides check on one periodic tick for all their streams, so liveness
costs nothing per token. TCP keepalive on every socket catches a peer host that vanished while idle.

Writes: the handshake and prologue leave together at the end of the turn they are written in; item
frames leave at once, one write per batch of items the handler had ready (runtime/ingress.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import uuid
import weakref

import orjson

from dynamo.aio import Acceptor

from .codec import PREFIX_LEN, FrameDecoder, FrameError, encode_frame
from .context import Context
from .errors import EngineError, StreamStalledError
from .mux import INFO_KEY as MUX_INFO_KEY
from .mux import MuxClientProtocol, is_mux_handshake
from .transport import (
    CONTROL_FRAMES,
    FRAME_COMPLETE,
    FRAME_HEARTBEAT,
    FRAME_PROLOGUE_OK,
    FRAME_SENTINEL,
    StreamState,
    encode_handshake,
    encode_prologue_error,
)

log = logging.getLogger(__name__)

TRANSPORT_NAME = "tcp_server"
_loads = orjson.loads
_PREFIX_UNPACK = struct.Struct(">QQQ").unpack_from
LIVENESS_TICKS = 4  # the client checks its streams LIVENESS_TICKS times per liveness bound
HEARTBEATS_PER_BOUND = 5  # the worker is asked for a heartbeat every bound / HEARTBEATS_PER_BOUND
_TCP_KEEPALIVE = tuple((getattr(socket, name), value) for name, value in
                       (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)) if hasattr(socket, name))


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # keepalive: a peer host that vanished while the stream is idle is noticed (~16 s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _TCP_KEEPALIVE:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        except OSError:
            pass


def _hex(instance_id: int | None) -> str:
    return f"{instance_id & 0xFFFFFFFFFFFFFFFF:x}" if instance_id is not None else "?"


def advertise_host(configured: str | None) -> str:
    """Address workers should dial to reach this process.

    ``DYN_TCP_RPC_HOST`` wins; otherwise the address the host name resolves to; otherwise loopback
    (correct for single-machine setups, the common case here).
    """
    if configured:
        return configured
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if addr and not addr.startswith("127."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


async def _listen(host: str) -> socket.socket:
    """A listening socket on an ephemeral port of ``host`` (an address or a name)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    family, _, _, _, addr = infos[0]
    return socket.create_server(addr, family=family, backlog=1024)


# ---------------------------------------------------------------------------------- client side


class TcpResponseServer:
    """The client process's listener for call-home streams; one per DistributedRuntime."""

    def __init__(self, host: str | None = None, liveness: float = 5.0, mux: bool = True) -> None:
        self.host = advertise_host(host)
        self.address = ""
        self.pending: dict[str, StreamState] = {}
        self.mux = mux  # offer workers one shared connection for all streams (runtime/mux.py)
        self.mux_pending: dict[int, StreamState] = {}  # by mux id: streams no frame has arrived for yet
        self.mux_connections: set[MuxClientProtocol] = set()
        self._next_mux_id = 0
        self._acceptor: Acceptor | None = None
        self._lock = asyncio.Lock()
        self.liveness = liveness
        self._heartbeat_ms = max(1, int(liveness * 1000 / HEARTBEATS_PER_BOUND))
        self.live: set[_CallHomeProtocol] = set()  # connected streams whose worker sends heartbeats
        self._ticker: asyncio.Task | None = None

    async def start(self) -> None:
        async with self._lock:
            if self._acceptor is not None:
                return
            try:
                sock = await _listen(self.host)
            except OSError as exc:
                if self.host == "127.0.0.1":
                    raise
                # e.g. a host name resolving to an address this machine no longer has
                log.warning("cannot listen on %s (%s); using 127.0.0.1 for response streams", self.host, exc)
                self.host = "127.0.0.1"
                sock = await _listen(self.host)
            # our own accept loop: a burst of call-homes is accepted in one turn (dynamo.aio.Acceptor)
            self._acceptor = Acceptor(sock, lambda: _CallHomeProtocol(self))
            port = sock.getsockname()[1]
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.address = f"{host}:{port}"
            self._ticker = asyncio.get_running_loop().create_task(self._check_liveness(), name="tcp-stream-liveness")

    def register(self, state: StreamState) -> dict:
        """Reserve a stream key for ``state``; returns the connection_info to put in the request."""
        key = uuid.uuid4().hex
        state.key = key
        self.pending[key] = state
        info = {"address": self.address, "subject": key, "context": state.request_id, "stream_type": "response",
                "heartbeat_ms": self._heartbeat_ms}
        if self.mux:
            self._next_mux_id += 1
            state.mux_id = self._next_mux_id
            self.mux_pending[state.mux_id] = state
            info[MUX_INFO_KEY] = state.mux_id  # ignored by workers that only call home per stream
        return {"transport": TRANSPORT_NAME, "info": info}

    def unregister(self, state: StreamState) -> None:
        self.pending.pop(state.key, None)
        if state.mux_id:
            self.mux_pending.pop(state.mux_id, None)

    def take(self, key: str) -> StreamState | None:
        """The stream a per-stream call-home names in its handshake (no longer waiting either way)."""
        state = self.pending.pop(key, None)
        if state is not None and state.mux_id:
            self.mux_pending.pop(state.mux_id, None)
        return state

    def take_mux(self, mux_id: int) -> StreamState | None:
        """The stream whose first frame arrived on a multiplexed connection."""
        state = self.mux_pending.pop(mux_id, None)
        if state is not None:
            self.pending.pop(state.key, None)
        return state

    def after_send(self, state: StreamState, handshake_timeout: float) -> None:
        """The worker acked: if it never calls home (it died in between), fail the stream."""

        def check() -> None:
            if not state.connected and not state.finished:
                self.unregister(state)
                state.fail(StreamStalledError())  # acked, then froze or died before calling home

        if not state.connected and not state.finished:
            state.timer = asyncio.get_running_loop().call_later(handshake_timeout, check)

    def on_instance_gone(self, states: list[StreamState]) -> None:
        """An instance's key vanished. Nothing to do here: a gracefully stopping worker deregisters first
        and still finishes its in-flight streams, a dead one closes its sockets, and a frozen one stops
        sending heartbeats (the liveness check fails its streams)."""

    async def _check_liveness(self) -> None:
        """Fail streams whose worker sent nothing, not even a heartbeat, for longer than the bound.

        Counting ticks rather than reading a clock per frame keeps the cost off the per-token path, and
        a loop that was itself stalled sees its sockets' data before its timers, so it blames no one.
        """
        period = self.liveness / LIVENESS_TICKS
        while True:
            await asyncio.sleep(period)
            stalled = []
            for proto in self.live:
                state = proto.state
                if state is None or state.finished:
                    stalled.append(proto)  # finished: just forget it
                elif state.paused:
                    state.quiet = 0  # we stopped reading (slow consumer): silence is ours, not the worker's
                else:
                    state.quiet += 1
                    if state.quiet > LIVENESS_TICKS:
                        stalled.append(proto)
            for mux in list(self.mux_connections):
                mux.quiet += 1
                if mux.quiet > LIVENESS_TICKS:
                    self.mux_connections.discard(mux)
                    streams = sum(1 for st in mux.streams.values() if st is not None and not st.finished)
                    log.warning("multiplexed connection from a worker: nothing, not even a heartbeat, for %.1fs; "
                                "treating its %d stream(s) as dead", self.liveness, streams)
                    mux.stalled()
            for proto in stalled:
                self.live.discard(proto)
                state = proto.state
                if state is not None and not state.finished:
                    log.warning("response stream %s: no data or heartbeat from worker %s for %.1fs; treating it "
                                "as dead", state.request_id, _hex(state.instance_id), self.liveness)
                    state.fail(StreamStalledError())
                    proto.send_control("kill")  # closes the socket: a worker that wakes up stops at once

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        for state in list(self.pending.values()):
            state.fail_incomplete()
        self.pending.clear()
        self.mux_pending.clear()
        for mux in list(self.mux_connections):
            mux.close()


class _CallHomeProtocol(asyncio.Protocol):
    """A worker's call-home connection: one response stream, or, when its first frame is the mux
    handshake, handed over to a :class:`MuxClientProtocol` carrying many (runtime/mux.py)."""

    __slots__ = ("server", "transport", "decoder", "state", "_head")

    def __init__(self, server: TcpResponseServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder()
        self.state: StreamState | None = None
        self._head = bytearray()  # bytes before the first frame (the handshake) is complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)

    def _handshake(self, data: bytes, transport: asyncio.Transport) -> bytes | None:
        """Read the first frame: which stream this is, or the switch to multiplexing.  Returns the bytes
        after it for this protocol, or None when there is nothing more for it (waiting, closed, handed over)."""
        head = self._head
        head += data
        if len(head) < PREFIX_LEN:
            return None
        header_len, body_len, _check = _PREFIX_UNPACK(head, 0)
        end = PREFIX_LEN + header_len + body_len
        if header_len > 65536 or body_len:  # a handshake is a small header-only frame
            transport.close()
            return None
        if len(head) < end:
            return None
        try:
            ctl = _loads(bytes(head[PREFIX_LEN:end]))
        except orjson.JSONDecodeError:
            transport.close()
            return None
        rest = bytes(head[end:])
        self._head = bytearray()
        if is_mux_handshake(ctl):
            mux = MuxClientProtocol(self.server, transport)
            self.transport = None
            if ctl.get("heartbeat_ms"):  # the worker sends heartbeats: hold the connection to the bound
                self.server.mux_connections.add(mux)
            transport.set_protocol(mux)
            if rest:
                mux.data_received(rest)
            return None
        state = self.server.take(ctl.get("subject", "") if isinstance(ctl, dict) else "")
        if state is None or state.finished:
            transport.close()
            return None
        self.state = state
        state.attach(self.send_control)
        if ctl.get("heartbeat_ms"):  # the worker sends heartbeats: hold it to the bound
            self.server.live.add(self)
        state.quiet = 0
        return rest

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        state = self.state
        if state is None:
            rest = self._handshake(data, transport)
            if not rest:
                return
            data = rest
            state = self.state
            assert state is not None
        try:
            frames = self.decoder.feed(data)
        except FrameError as exc:
            log.warning("bad frame from worker: %s", exc)
            transport.close()
            return
        for header, body in frames:
            if body:
                msg = _loads(body)
                ann = msg.get("data")
                if ann is not None:
                    if state.finished:
                        log.error("Response received after generation ended - this should never happen")
                        continue
                    state.items.append(ann)
                elif msg.get("complete_final"):
                    state.complete()
                else:
                    state.fail(EngineError("Empty response received - this should never happen"))
            elif header:
                ctl = _loads(header)
                if isinstance(ctl, dict):
                    if ctl.get("error"):
                        state.fail(EngineError(str(ctl["error"])))
                elif ctl == "sentinel":
                    transport.close()
        state.quiet = 0
        if len(state.items) > state.HIGH_WATER and not state.finished:
            state.pause(transport.pause_reading, transport.resume_reading)
        state.wake()

    def send_control(self, kind: str) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(CONTROL_FRAMES[kind])
        if kind == "kill":
            transport.close()  # buffered bytes (the kill frame) are flushed before the close

    def connection_lost(self, exc: Exception | None) -> None:
        state = self.state
        if state is not None and not state.finished:
            state.fail_incomplete()
        self.transport = None
        self.server.live.discard(self)


# ---------------------------------------------------------------------------------- worker side


class TcpSink(asyncio.Protocol):
    """Worker end of one call-home stream: buffered, coalesced writes; stop/kill from the client."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.transport: asyncio.Transport | None = None
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._paused = False
        self._drain: asyncio.Future | None = None
        self._decoder = FrameDecoder()
        self.finished = False
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self.heartbeat_s = 0.0
        self.wrote = False  # something left since the heartbeat ticker last looked

    @classmethod
    async def connect(cls, info: dict, context: Context, timeout: float = 10.0) -> "TcpSink":
        host, _, port = str(info["address"]).rpartition(":")
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        _, sink = await asyncio.wait_for(loop.create_connection(lambda: cls(context), host, int(port)), timeout)
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
        _nodelay(transport)

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
        if self._pending:
            self._pending.append(frame)
            return
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(frame)

    def queue(self, frame: bytes) -> None:
        """Send at the end of this loop turn, together with whatever else is written until then."""
        self._pending.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.wrote = True
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending.clear()
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
        self._pending.append(FRAME_COMPLETE)
        self._pending.append(FRAME_SENTINEL)
        self._flush()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close without the completion marker (the client then reports an incomplete stream)."""
        self.finished = True
        self._flush()
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
                    elif not sink._pending and not sink._paused:
                        transport.write(FRAME_HEARTBEAT)  # direct: the next tick still sees the stream idle
        finally:
            self.task = None


__all__ = ["TcpResponseServer", "TcpSink", "advertise_host", "TRANSPORT_NAME", "encode_frame"]
