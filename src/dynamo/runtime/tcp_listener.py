"""TCP call-home, the client side: the process that sends requests listens, and each worker it asked
connects back to deliver one response stream (or, after the mux handshake, all of its streams over one
connection: :mod:`.mux_listener`).

One listener per runtime. A request reserves a stream key (and a multiplexed stream id when the client
offers multiplexing); the worker's handshake names it and the connection is attached to that request's
:class:`StreamState`. Liveness: one periodic task fails the streams (and multiplexed connections) that
sent nothing, not even a heartbeat, for the liveness bound.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import uuid

import orjson

from dynamo.aio import Acceptor
from dynamo.bounds import track

from . import tcp_tls
from .codec import PREFIX_LEN, FrameDecoder, FrameError
from .errors import EngineError, StreamStalledError
from .fleet_auth import FleetAuth, guarded, is_fleet_hello, peer_name, refusals
from .mux import INFO_KEY as MUX_INFO_KEY
from .mux import is_mux_handshake
from .mux_listener import MuxClientProtocol
from .tcp import (
    DEFAULT_SILENCE_1X,
    HEARTBEATS_PER_BOUND,
    LIVENESS_TICKS,
    TRANSPORT_NAME,
    advertise_host,
    instance_hex,
    listen,
    tune_socket,
)
from .transport import CONTROL_FRAMES, StreamState

log = logging.getLogger(__name__)
_ANNOTATED_KEYS = frozenset(("data", "id", "event", "comment"))

_loads = orjson.loads
_PREFIX_UNPACK = struct.Struct(">QQQ").unpack_from


class TcpResponseServer:
    """The client process's listener for call-home streams; one per DistributedRuntime."""

    def __init__(self, host: str | None = None, liveness: float = 5.0, mux: bool = True,
                 bind: str | None = None, auth: FleetAuth | None = None,
                 silence_1x: float = DEFAULT_SILENCE_1X) -> None:
        self.auth = auth  # the fleet secret's keys: a worker proves it before its stream is read (None: none)
        self.host = advertise_host(host)  # the address workers dial
        self.bind = bind or self.host  # where the listener binds (a wildcard: every interface)
        self.address = ""
        self.pending: dict[str, StreamState] = {}
        self.mux = mux  # offer workers one shared connection for all streams (runtime/mux.py)
        self.mux_pending: dict[int, StreamState] = {}  # by mux id: streams no frame has arrived for yet
        self.mux_connections: set[MuxClientProtocol] = set()
        self.pending_bytes = 0  # unfinished envelopes over all multiplexed connections (mux_listener.MAX_PENDING)
        self._next_mux_id = 0
        self._acceptor: Acceptor | None = None
        self._lock = asyncio.Lock()
        self.liveness = liveness
        self._heartbeat_ms = max(1, int(liveness * 1000 / HEARTBEATS_PER_BOUND))
        self.live: set[_CallHomeProtocol] = set()  # connected streams whose worker sends heartbeats
        # connected streams of Dynamo 1.x workers, which send no heartbeats: held to ``silence_1x`` seconds
        # without data once their first token came (0: not held)
        self.unbeating: set[_CallHomeProtocol] = set()
        self.silence_1x = silence_1x
        self._ticker: asyncio.Task | None = None
        track("response_streams_pending", self, lambda s: len(s.pending) + len(s.mux_pending))
        track("response_streams_live", self, lambda s: len(s.live))
        track("response_streams_mux", self, lambda s: sum(len(c.streams) for c in s.mux_connections))

    async def start(self) -> None:
        async with self._lock:
            if self._acceptor is not None:
                return
            try:
                sock = await listen(self.bind)
            except OSError as exc:
                if self.bind == "127.0.0.1":
                    raise
                # e.g. a host name resolving to an address this machine no longer has
                log.warning("cannot listen on %s (%s); using 127.0.0.1 for response streams", self.bind, exc)
                self.host = self.bind = "127.0.0.1"
                sock = await listen(self.host)
            # our own accept loop: a burst of call-homes is accepted in one turn (dynamo.aio.Acceptor)
            port = sock.getsockname()[1]
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.address = f"{host}:{port}"
            self._acceptor = Acceptor(sock, guarded(self.auth, lambda: self.address, lambda: _CallHomeProtocol(self),
                                                    "response streams"),
                                      **tcp_tls.acceptor_options("response streams"))
            self._ticker = asyncio.get_running_loop().create_task(self._check_liveness(), name="tcp-stream-liveness")

    def register(self, state: StreamState) -> dict:
        """Reserve a stream key for ``state``; returns the connection_info to put in the request.

        It offers every worker our extras: ``heartbeat_ms`` (send heartbeats while idle) and, with
        multiplexing on, ``mux_stream`` (one shared connection for all streams). A worker's call-home says
        which it honours (:class:`_CallHomeProtocol`); a Dynamo 1.x worker ignores both and calls home per
        stream with none, and its streams are then held to 1.x's bounds."""
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
            if self.unbeating and self.silence_1x > 0:
                stalled.extend(self._silent_1x(period))
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
                    if proto in self.unbeating:
                        self.unbeating.discard(proto)
                        log.warning("response stream %s: nothing from Dynamo 1.x worker %s for %.0fs after its "
                                    "first token (it sends no heartbeats: frozen, or its host cut off; "
                                    "DYN_STREAM_SILENCE_1X_S); treating it as dead", state.request_id,
                                    instance_hex(state.instance_id), self.silence_1x)
                    else:
                        log.warning("response stream %s: no data or heartbeat from worker %s for %.1fs; treating "
                                    "it as dead", state.request_id, instance_hex(state.instance_id), self.liveness)
                    state.fail(StreamStalledError())
                    proto.send_control("kill")  # closes the socket: a worker that wakes up stops at once

    def _silent_1x(self, period: float) -> list["_CallHomeProtocol"]:
        """The 1.x streams silent past the bound since their first token (a 1.x worker sends nothing while it
        prefills or queues, so the bound starts at its first token: before it, only the client's patience
        bounds a frozen 1.x worker). Forgets the finished ones."""
        ticks = max(1, round(self.silence_1x / period))
        out = []
        for proto in list(self.unbeating):
            state = proto.state
            if state is None or state.finished:
                self.unbeating.discard(proto)
            elif not proto.spoke or state.paused:
                state.quiet = 0
            else:
                state.quiet += 1
                if state.quiet > ticks:
                    out.append(proto)
        return out

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

    __slots__ = ("server", "transport", "decoder", "state", "_head", "spoke", "beats")

    def __init__(self, server: TcpResponseServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder()
        self.state: StreamState | None = None
        self._head = bytearray()  # bytes before the first frame (the handshake) is complete
        self.spoke = False  # an item came (a 1.x stream's silence bound starts there)
        self.beats = True  # its handshake offered heartbeats (False: a 1.x worker, which has none of our extras)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        tune_socket(transport)

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
            if is_fleet_hello(head):
                peer = peer_name(transport)
                refusals((peer.rpartition(":")[0], "no secret"), f"response streams: refused a connection from "
                         f"{peer}: it authenticates with a fleet secret and this process has none "
                         "(set DYN_FLEET_SECRET)")
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
        else:  # a Dynamo 1.x worker: held to the longer silence bound once it has spoken
            self.beats = False
            self.server.unbeating.add(self)
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
                try:
                    msg = _loads(body)
                except ValueError as exc:  # orjson's decode errors are ValueErrors
                    state.fail(EngineError(f"undecodable response from the worker: {exc}"))
                    transport.close()
                    return
                ann = msg.get("data") if isinstance(msg, dict) else None
                if not self.beats and isinstance(ann, dict) and not ann.keys() & _ANNOTATED_KEYS:
                    ann = {"data": ann}  # a 1.x control endpoint's answer (not Annotated): the item itself
                if ann is not None:
                    if state.finished:
                        log.error("Response received after generation ended - this should never happen")
                        continue
                    state.items.append(ann)
                elif isinstance(msg, dict) and msg.get("complete_final"):
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
        if state.items:  # an item came in this read (the consumer runs later)
            self.spoke = True
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
        self.server.unbeating.discard(self)


# ---------------------------------------------------------------------------------- worker side
