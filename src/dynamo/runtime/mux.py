"""Multiplexed call-home: one TCP connection from a worker to a client process carries all its streams.

Why: with a connection per stream (the original's protocol) every token costs one ``send`` on
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

This module is the wire format both ends share; the client's end is :mod:`.mux_listener`, the worker's
:mod:`.mux_callhome`.
"""
from __future__ import annotations

import logging
import struct
from typing import Any

import orjson

from dynamo.lazyjson import LazyJson

from .annotated import Annotated
from .codec import PREFIX_LEN, FrameError, encode_frame
from .transport import (
    CONTROL_FRAMES,
    FRAME_COMPLETE,
    FRAME_HEARTBEAT,
    FRAME_SENTINEL,
    encode_item,
)

log = logging.getLogger(__name__)

MUX_VERSION = 1
INFO_KEY = "mux_stream"  # connection-info key: the client accepts this stream multiplexed, under this id
_ENVELOPE = struct.Struct(">QQ")
ENVELOPE_LEN = _ENVELOPE.size  # 16
pack_envelope = _ENVELOPE.pack
unpack_envelope = _ENVELOPE.unpack_from
unpack_prefix = struct.Struct(">QQQ").unpack_from
MAX_ENVELOPE = 256 * 1024 * 1024
WRITE_HIGH_WATER = 4 * 1024 * 1024  # a worker's bytes waiting for the kernel before its streams pause

FRAME_PAUSE = encode_frame(header=b'"pause"')
FRAME_RESUME = encode_frame(header=b'"resume"')
CLIENT_CONTROL = {**CONTROL_FRAMES, "pause": FRAME_PAUSE, "resume": FRAME_RESUME}
HEARTBEAT_ENVELOPE = pack_envelope(0, len(FRAME_HEARTBEAT)) + FRAME_HEARTBEAT
ITEM_HEADER = b'"item"'  # a plain item, its JSON as the body: no Annotated wrapping to decode
ITEM_HEADER_LEN = len(ITEM_HEADER)
_pack_prefix = struct.Struct(">QQQ").pack
_dumps = orjson.dumps


def encode_plain_item(item: Any) -> bytes:
    """A stream item as a multiplexed connection carries it: an ``"item"`` frame whose body is the
    item's JSON (Annotated items, errors included, keep the ordinary frame)."""
    if isinstance(item, Annotated):
        return encode_item(item)
    body = item.raw if type(item) is LazyJson and item.raw is not None else _dumps(item)  # (see encode_item)
    return _pack_prefix(ITEM_HEADER_LEN, len(body), 0) + ITEM_HEADER + body
END_OK = FRAME_COMPLETE + FRAME_SENTINEL


def envelope(stream_id: int, data: bytes) -> bytes:
    """One envelope: ``data`` (whole frames of stream ``stream_id``) behind its 16-byte prefix."""
    return pack_envelope(stream_id, len(data)) + data


def encode_mux_handshake(heartbeat_ms: int | None) -> bytes:
    ctl: dict[str, Any] = {"stream_type": "mux", "mux": MUX_VERSION}
    if heartbeat_ms:
        ctl["heartbeat_ms"] = heartbeat_ms
    return encode_frame(header=orjson.dumps(ctl))


def is_mux_handshake(ctl: Any) -> bool:
    return isinstance(ctl, dict) and ctl.get("stream_type") == "mux"


class EnvelopeTooLarge(FrameError):
    """An envelope announced more bytes than the reader accepts (raised from its 16-byte prefix, before any
    of them is buffered)."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"an envelope of {length} bytes announced (at most {limit} accepted)")
        self.length = length
        self.limit = limit


class EnvelopeDecoder:
    """Incremental decoder of envelopes: ``feed(bytes)`` -> [(stream id, payload)] now complete.

    ``max_len`` bounds one envelope; a longer one raises :class:`EnvelopeTooLarge` as soon as its prefix
    arrives, so a peer cannot make the reader buffer more than that by announcing it.
    """

    __slots__ = ("_buf", "max_len")

    def __init__(self, max_len: int = MAX_ENVELOPE) -> None:
        self._buf = bytearray()
        self.max_len = max_len

    @property
    def buffered(self) -> int:
        """Bytes held for an envelope whose end has not arrived yet."""
        return len(self._buf)

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
        limit = self.max_len
        while size - pos >= ENVELOPE_LEN:
            sid, length = unpack_envelope(src, pos)
            if length > limit:
                raise EnvelopeTooLarge(length, limit)
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
        header_len, body_len, _check = unpack_prefix(payload, pos)
        start = pos + PREFIX_LEN
        mid = start + header_len
        end = mid + body_len
        if end > size:
            raise FrameError("envelope ends inside a frame")
        frames.append((payload[start:mid], payload[mid:end]))
        pos = end
    return frames


# ---------------------------------------------------------------------------------- client side
