"""Multiplexed call-home, the client side: one worker's connection carrying many response streams,
demultiplexed to each request's :class:`StreamState` (wire format: :mod:`.mux`).

The call-home listener (:mod:`.tcp_listener`) hands a connection over to :class:`MuxClientProtocol` once
it has read the mux handshake; the listener's stream registry (:class:`MuxStreams`) says which request a
stream id belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Protocol

import orjson

from .codec import PREFIX_LEN, FrameError
from .errors import EngineError, StreamStalledError
from .fleet_auth import peer_name, refusals
from .mux import (
    CLIENT_CONTROL,
    ENVELOPE_LEN,
    ITEM_HEADER_LEN,
    MAX_ENVELOPE,
    pack_envelope,
    split_frames,
    unpack_envelope,
    unpack_prefix,
)
from .transport import StreamState

log = logging.getLogger(__name__)

_loads = orjson.loads


# The most a client process holds, over all its multiplexed connections, in envelopes whose end has not
# arrived yet. A worker writes each envelope whole, so this is transient; it bounds what peers that reach
# the call-home port without a fleet secret can make this process buffer (one envelope may be up to
# MAX_ENVELOPE: a response item, a batch of embeddings, can legitimately be large). The connection that
# would take the total over it is dropped.
MAX_PENDING = 1024 * 1024 * 1024


class MuxStreams(Protocol):
    """What a multiplexed connection needs from the listener that accepted it."""

    mux_connections: "set[MuxClientProtocol]"  # connections held to the liveness bound
    pending_bytes: int  # bytes of unfinished envelopes over all its multiplexed connections (MAX_PENDING)

    def take_mux(self, mux_id: int) -> StreamState | None:
        """The request waiting for stream ``mux_id`` (no longer waiting after this), or None."""


class MuxClientProtocol(asyncio.Protocol):
    """The client's end of one worker's multiplexed connection: demultiplexes to each StreamState.

    Installed on the transport by the call-home listener once it has read the mux handshake.
    """

    def __init__(self, server: MuxStreams, transport: asyncio.Transport) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = transport
        self._buf = bytearray()  # the start of an envelope whose end has not arrived yet
        self._held = 0  # len(self._buf) as counted in server.pending_bytes
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
        unpack_env = unpack_envelope
        unpack = unpack_prefix
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
                    if header_len == ITEM_HEADER_LEN and body_len:  # "item": a plain item's JSON
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
        if len(buf) != self._held and self._count_held(len(buf), transport):
            return
        high = StreamState.HIGH_WATER
        for sid, state in touched.items():
            if len(state.items) > high and not state.finished and not state.paused:
                state.pause(_Control(self, sid, "pause"), _Control(self, sid, "resume"))
            state.wake()

    def _count_held(self, held: int, transport: asyncio.Transport) -> bool:
        """Count this connection's unfinished envelope in the listener's total; True if that dropped it."""
        server = self.server
        server.pending_bytes += held - self._held
        self._held = held
        if server.pending_bytes <= MAX_PENDING:
            return False
        peer = peer_name(transport)
        refusals((peer.rpartition(":")[0], "pending"), f"response streams: dropping a connection from {peer}: "
                 f"the responses not yet complete on all connections would exceed {MAX_PENDING} bytes (this one "
                 f"holds {held})")
        transport.close()
        return True

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
            frame = CLIENT_CONTROL[kind]
            transport.write(pack_envelope(sid, len(frame)) + frame)

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
        self.server.pending_bytes -= self._held
        self._held = 0
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
