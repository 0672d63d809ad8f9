"""Two-part frames, the unit of every message between a client and a worker (the original's
wire format, so our clients and workers interoperate with the original's).

A frame is a 24-byte header of three big-endian u64 (header_len, body_len, checksum), then the header
bytes, then the body bytes. The header carries control JSON, the body carries data. The checksum is
xxh3-64 of header||body when the ``xxhash`` package is installed, else 0 ("not checked", as the
original's 0.4 release builds send); a non-zero checksum is verified when we can.
"""

from __future__ import annotations

import struct

try:  # optional: only for interoperating with 0.3 builds, which insist on real checksums
    from xxhash import xxh3_64_intdigest as _xxh3
except ImportError:  # pragma: no cover - depends on the environment
    _xxh3 = None  # type: ignore[assignment]

_PREFIX = struct.Struct(">QQQ")
PREFIX_LEN = _PREFIX.size  # 24
MAX_FRAME = 256 * 1024 * 1024  # refuse absurd lengths rather than buffer forever


class FrameError(ValueError):
    """Malformed frame (bad lengths or checksum)."""


def checksum(header: bytes, body: bytes) -> int:
    return _xxh3(header + body) if _xxh3 is not None else 0


def encode_frame(header: bytes = b"", body: bytes = b"", *, with_checksum: bool = False) -> bytes:
    """One frame. Hot-path callers leave ``with_checksum`` off (0 = unchecked)."""
    check = checksum(header, body) if with_checksum else 0
    return _PREFIX.pack(len(header), len(body), check) + header + body


def decode_frame(data: bytes) -> tuple[bytes, bytes]:
    """Decode exactly one frame (e.g. a NATS request payload)."""
    if len(data) < PREFIX_LEN:
        raise FrameError("frame shorter than its 24-byte prefix")
    header_len, body_len, check = _PREFIX.unpack_from(data, 0)
    if PREFIX_LEN + header_len + body_len != len(data):
        raise FrameError("frame length mismatch")
    header = data[PREFIX_LEN:PREFIX_LEN + header_len]
    body = data[PREFIX_LEN + header_len:]
    if check and _xxh3 is not None and _xxh3(header + body) != check:
        raise FrameError("frame checksum mismatch")
    return header, body


class FrameDecoder:
    """Incremental decoder for a byte stream of frames (TCP)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """Add bytes; return every frame now complete, in order."""
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:
            src = data  # the usual case, whole frames in one read: no copy into the buffer
        frames: list[tuple[bytes, bytes]] = []
        pos = 0
        size = len(src)
        unpack = _PREFIX.unpack_from
        while size - pos >= PREFIX_LEN:
            header_len, body_len, _check = unpack(src, pos)
            if header_len > MAX_FRAME or body_len > MAX_FRAME:
                raise FrameError("frame too large")
            start = pos + PREFIX_LEN
            mid = start + header_len
            end = mid + body_len
            if end > size:
                break
            frames.append((bytes(src[start:mid]), bytes(src[mid:end])))
            pos = end
        if src is buf:
            if pos:
                del buf[:pos]
        elif pos < size:
            buf += data[pos:]  # a partial frame waits for the next read
        return frames
