"""Moving one sequence's KV state from a prefill worker to a decode worker, directly over TCP.

Why a direct stream: the state is big (SmolLM2-135M in f16: about 23 KB per token, 46 MB for a 2k-token
prompt) and must not go through etcd, NATS or the frontend.  The prefill worker keeps the exported state
in a bounded :class:`ExportStore` and serves it from a :class:`TransferServer`; its answer to the
frontend carries only a small :class:`Ticket` (address, key, size, digest).  The decode worker dials the
address and pulls the state with :func:`pull` (as NIXL does: the consumer reads the producer's memory).

Wire format of a pull (all integers big-endian):

    request   b"DKVP" | u16 key length | key (utf-8)
    response  b"DKVS" | u8 status (0 ok, 1 unknown key) | u64 total size | 32-byte sha256 of the state
              then chunks: u32 length | u32 crc32 | bytes, and a final chunk of length 0

Every chunk is checked (crc32) as it arrives, the whole state against the sha256 and the announced size
at the end, and nothing longer than the reader's limit is accepted.  The writer awaits ``drain()`` after
each chunk, so a slow reader slows the writer instead of filling its memory (back-pressure); the reader
holds at most the state itself.  Any mismatch, early end or timeout raises :class:`TransferError`, and the
decode worker then prefills locally.

With a fleet secret (``DYN_FLEET_SECRET``) both ends run the request plane's handshake first
(:func:`~dynamo.runtime.fleet_auth.handshake_streams`): the server reads no key from a peer that has not
proved it holds the secret, and the decode worker reads no state from a server that has not. Without one,
a state is guarded only by its ticket's key (96 random bits, good for one pull within its TTL).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from dynamo.runtime.fleet_auth import DIALER, LISTENER, FleetAuth, FleetAuthError, handshake_streams, refusals

log = logging.getLogger(__name__)

REQ_MAGIC = b"DKVP"
RESP_MAGIC = b"DKVS"
CHUNK = 256 * 1024
DEFAULT_MAX_BYTES = 1 << 30  # a reader refuses states larger than this
_RESP_HEAD = struct.Struct(">4sBQ32s")
_CHUNK_HEAD = struct.Struct(">II")


class TransferError(Exception):
    """The state could not be fetched intact: the decode worker must prefill locally."""


@dataclass(frozen=True)
class Ticket:
    """What the prefill worker returns instead of the state: where and how to fetch it."""

    address: str  # host:port of the prefill worker's TransferServer
    key: str
    size: int
    sha256: str  # hex
    n_tokens: int  # prompt tokens the state covers
    first_token: int  # the token sampled after the prompt

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Ticket":
        try:
            return cls(address=str(d["address"]), key=str(d["key"]), size=int(d["size"]), sha256=str(d["sha256"]),
                       n_tokens=int(d["n_tokens"]), first_token=int(d["first_token"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed KV transfer ticket: {e}") from None


class ExportStore:
    """Exported states waiting to be pulled: bounded in bytes, oldest dropped first, each kept ``ttl`` s.

    A state is removed when pulled (one consumer per prefill) or when it expires (the decode worker
    died, or the request was cancelled).  Adding beyond ``max_bytes`` evicts the oldest; a state larger
    than ``max_bytes`` by itself is refused (the caller then tells the frontend to prefill locally).
    """

    def __init__(self, max_bytes: int = 512 << 20, ttl: float = 60.0, clock: Any = time.monotonic) -> None:
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self._items: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def put(self, data: bytes) -> tuple[str, str]:
        """Keep ``data``; returns (key, sha256 hex).  Raises TransferError when it can never fit."""
        if len(data) > self.max_bytes:
            raise TransferError(f"KV state of {len(data)} bytes exceeds the export store ({self.max_bytes} bytes)")
        self._expire()
        while self.bytes + len(data) > self.max_bytes and self._items:
            self._drop(next(iter(self._items)))
            self.evicted += 1
        key = os.urandom(12).hex()
        digest = hashlib.sha256(data).hexdigest()
        self._items[key] = (self.clock() + self.ttl, data, digest)
        self.bytes += len(data)
        return key, digest

    def take(self, key: str) -> tuple[bytes, str] | None:
        self._expire()
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= len(item[1])
        return item[1], item[2]

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, key: str) -> None:
        _, data, _ = self._items.pop(key)
        self.bytes -= len(data)

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            key, (deadline, _, _) = next(iter(self._items.items()))
            if deadline > now:
                break
            self._drop(key)


def encode_response(data: bytes, digest_hex: str, chunk: int = CHUNK) -> list[bytes]:
    """The frames of an ok response (used by the server; tests use it to forge bad ones)."""
    frames = [_RESP_HEAD.pack(RESP_MAGIC, 0, len(data), bytes.fromhex(digest_hex))]
    view = memoryview(data)
    for off in range(0, len(data), chunk):
        part = view[off:off + chunk]
        frames.append(_CHUNK_HEAD.pack(len(part), zlib.crc32(part)) + part.tobytes())
    frames.append(_CHUNK_HEAD.pack(0, 0))
    return frames


NO_DIGEST = b"\0" * 32  # a response without a sha256 (prefix sharing: each chunk's crc32 guards it)
NOT_HELD = _RESP_HEAD.pack(RESP_MAGIC, 1, 0, NO_DIGEST)  # the response when the server has no such state


async def write_state(writer: asyncio.StreamWriter, data: Any, digest_hex: str | None, chunk: int = CHUNK) -> None:
    """Send an ok response for ``data`` (any bytes-like object: sent from its own memory, chunk by chunk,
    awaiting ``drain()`` after each, so a slow reader slows the writer); ``digest_hex`` None: no sha256."""
    view = memoryview(data).cast("B")
    writer.write(_RESP_HEAD.pack(RESP_MAGIC, 0, len(view), bytes.fromhex(digest_hex) if digest_hex else NO_DIGEST))
    for off in range(0, len(view), chunk):
        part = view[off:off + chunk]
        writer.write(_CHUNK_HEAD.pack(len(part), zlib.crc32(part)))
        writer.write(part)
        await writer.drain()  # back-pressure: never more than a chunk or two queued per reader
    writer.write(_CHUNK_HEAD.pack(0, 0))
    await writer.drain()


class StateServer:
    """A TCP listener that hands out KV states, one request per connection: the fleet-secret handshake
    first when there is one (a refused peer is one log line and never reaches :meth:`answer`), then the
    subclass's :meth:`answer`.  ``what`` names it in log lines."""

    what = "KV transfer"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None, chunk: int = CHUNK,
                 auth: FleetAuth | None = None) -> None:
        self.host, self.port, self.chunk = host, port, chunk
        self.auth = auth  # the fleet secret's keys: a peer proves it before its request is read
        self._advertise = advertise
        self._server: asyncio.base_events.Server | None = None
        self.address = ""
        self.served = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self._advertise or self.host}:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.auth is not None:
                try:
                    await handshake_streams(self.auth, LISTENER, self.address, reader, writer)
                except FleetAuthError as exc:
                    peer = writer.get_extra_info("peername")
                    host = str(peer[0]) if isinstance(peer, tuple) else "?"
                    refusals((host, str(exc)), f"{self.what}: refused a connection from {host}: {exc}")
                    return
            await self.answer(reader, writer)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError, struct.error) as e:
            log.debug("%s connection ended: %r", self.what, e)
        finally:
            writer.close()

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class TransferServer(StateServer):
    """Serves :class:`ExportStore` entries to decode workers on a TCP port of the prefill worker."""

    def __init__(self, store: ExportStore, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, chunk: int = CHUNK, auth: FleetAuth | None = None) -> None:
        super().__init__(host, port, advertise, chunk, auth)
        self.store = store

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readexactly(6), 10.0)
        magic, n = struct.unpack(">4sH", head)
        if magic != REQ_MAGIC:
            return
        key = (await asyncio.wait_for(reader.readexactly(n), 10.0)).decode("utf-8", "replace")
        item = self.store.take(key)
        if item is None:
            writer.write(NOT_HELD)
            await writer.drain()
            return
        data, digest = item
        t0 = time.perf_counter()
        await write_state(writer, data, digest, self.chunk)
        self.served += 1
        log.debug("KV state %s: %d bytes sent in %.1f ms", key, len(data), 1e3 * (time.perf_counter() - t0))


async def read_state(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_BYTES,
                     expect: Ticket | None = None) -> bytearray:
    """Read and verify one response (each chunk's crc32, the whole state's size and, unless it came
    without one (NO_DIGEST, and no ``expect``), its sha256 against the header; the header against
    ``expect``'s size and digest when given).  TransferError on any mismatch or early end, or a state
    over ``max_bytes``."""
    try:
        magic, status, total, digest = _RESP_HEAD.unpack(await reader.readexactly(_RESP_HEAD.size))
        if magic != RESP_MAGIC:
            raise TransferError("KV transfer: not a KV state response")
        if status == 1:
            raise TransferError("KV transfer: the worker no longer holds this state (expired or evicted)")
        if status != 0:
            raise TransferError(f"KV transfer: status {status}")
        if total > max_bytes:
            raise TransferError(f"KV transfer: {total} bytes exceeds the limit of {max_bytes}")
        if expect is not None and (total != expect.size or digest.hex() != expect.sha256):
            raise TransferError("KV transfer: the state does not match its ticket")
        buf = bytearray()
        while True:
            n, crc = _CHUNK_HEAD.unpack(await reader.readexactly(_CHUNK_HEAD.size))
            if n == 0:
                break
            if len(buf) + n > total:
                raise TransferError("KV transfer: more bytes than announced")
            part = await reader.readexactly(n)
            if zlib.crc32(part) != crc:
                raise TransferError(f"KV transfer: chunk at offset {len(buf)} is corrupt (crc32 mismatch)")
            buf += part
    except asyncio.IncompleteReadError:
        raise TransferError("KV transfer: the stream ended early (truncated)") from None
    if len(buf) != total:
        raise TransferError(f"KV transfer: got {len(buf)} of {total} bytes (truncated)")
    if (digest != NO_DIGEST or expect is not None) and hashlib.sha256(buf).digest() != digest:
        raise TransferError("KV transfer: sha256 mismatch")
    return buf


async def read_response(reader: asyncio.StreamReader, expect: Ticket, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Read and verify the response to a ticket's pull; raises TransferError on any mismatch or early end."""
    return bytes(await read_state(reader, max_bytes, expect))


async def dial(address: str, auth: FleetAuth | None, what: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a state server at ``host:port`` and, with a fleet secret, prove it both ways (a refusal
    is a TransferError naming ``what``).  The caller bounds the time and closes the writer."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    if auth is not None:
        try:
            await handshake_streams(auth, DIALER, address, reader, writer)
        except FleetAuthError as exc:
            writer.close()
            raise TransferError(f"{what} from {address}: {exc}") from None
    return reader, writer


async def pull(ticket: Ticket, timeout: float = 30.0, max_bytes: int = DEFAULT_MAX_BYTES,
               auth: FleetAuth | None = None) -> bytes:
    """Fetch the state a ticket names from its prefill worker; TransferError when that fails (``auth``:
    the fleet secret's keys, proved both ways before the key is sent)."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await dial(ticket.address, auth, "KV transfer")
            try:
                key = ticket.key.encode()
                writer.write(struct.pack(">4sH", REQ_MAGIC, len(key)) + key)
                await writer.drain()
                data = await read_response(reader, ticket, max_bytes)
            finally:
                writer.close()
    except TimeoutError:
        raise TransferError(f"KV transfer from {ticket.address} timed out after {timeout:g} s") from None
    except (OSError, ValueError) as e:
        raise TransferError(f"KV transfer from {ticket.address} failed: {e}") from None
    dt = time.perf_counter() - t0
    log.debug("KV state pulled from %s: %d bytes, %d tokens in %.1f ms (%.0f MB/s)", ticket.address, len(data),
              ticket.n_tokens, 1e3 * dt, len(data) / max(dt, 1e-9) / 1e6)
    return data
