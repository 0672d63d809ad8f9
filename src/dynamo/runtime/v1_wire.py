"""Dynamo 1.x's TCP request plane, the bytes: what a 1.x frontend sends a worker and what a 1.x worker
sends back, so that our processes and Dynamo 1.6.1's serve each other (docs/runtime.md, "Dynamo 1.x").

Why a second wire beside our envelopes (:mod:`.tcp_request_plane`): a 1.x process speaks only this one.
Our own processes keep the multiplexed envelopes between themselves; this wire is spoken when the peer is
1.x: a worker tells by a connection's first bytes, a client by the instance's address.

Facts (observed from the 1.6.1 wheels on the wire, and in its public source):

* Request (client -> worker, many on one persistent connection): u16 BE path length, the path
  ``{instance_id:x}/{namespace}/{component}/{endpoint}``, u16 BE headers length, the headers (a JSON
  object: ``request-id``, ``x-endpoint-path``, a W3C ``traceparent`` when tracing), u32 BE payload length,
  the payload: a two-part frame (:mod:`.codec`) whose header is the control JSON (``id``,
  ``request_type``, ``response_type``, ``payload_codec``, ``connection_info``) and whose body is the
  request in ``payload_codec`` (``"msgpack"`` by default in 1.6; absent means JSON).
* Ack (worker -> client, one per request, in request order: it names no request): u32 BE length and
  that many bytes; empty means taken, anything else is the refusal's text.
* The response stream comes back over call-home exactly as ours (:mod:`.transport`), its data frames'
  bodies in the request's codec: ``{"data": <Annotated>, "complete_final": false}`` per item, then
  ``{"complete_final": true}``; handshake, prologue, ``"sentinel"``, ``"stop"`` and ``"kill"`` stay JSON
  headers.

How a worker tells the two wires apart on one port: ours starts with an envelope whose first 8 bytes are
the request number (u64 BE, counted from 1 per connection, so its first two bytes are zero for the first
2**48 requests), 1.x's with the path's length, a u16 that is never zero. A fleet secret's hello starts
with 0xff (:mod:`.fleet_auth`) and is told apart before either.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import msgspec
import orjson

from dynamo.lazyjson import LazyJson

from .annotated import Annotated, BareItem
from .codec import encode_frame
from .names import is_v1_tcp_address

MSGPACK = "msgpack"
JSON = "json"
CODEC_KEY = "payload_codec"  # in the control JSON; its presence is how a worker knows a 1.x client
MAX_REQUEST = 32 * 1024 * 1024  # 1.x's DYN_TCP_MAX_MESSAGE_SIZE default, and ours
# 1.6.1's own refusals (the text of a non-empty ack), so a 1.x client reads ours as it reads its own
ACK_OVERLOADED = "Server overloaded: worker at capacity"
ACK_UNAVAILABLE = "Server unavailable: instance shutting down"
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_pack_u16 = _U16.pack
_pack_u32 = _U32.pack
_EMPTY_ACK = _pack_u32(0)
# host:port/{id:x}/{ns}/{comp}/{ep}: a 1.x instance record's "tcp" transport (no scheme; ours have tcp://)
_ADDRESS = re.compile(r"^(?P<hostport>[^/]+:\d+)/(?P<path>[0-9a-f]{1,16}/[^/]+/[^/]+/[^/]+)$")

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
msgpack_decode = _msgpack_decoder.decode


class V1WireError(ValueError):
    """Bytes that are not Dynamo 1.x's request plane (or exceed its limits)."""


def looks_like_v1(first: bytes) -> bool:
    """True when a connection's first two bytes start a 1.x request (a path length) rather than our
    envelope (a request number's zero high bytes). Call with at least two bytes."""
    return first[0] != 0 or first[1] != 0


def is_v1_address(address: str) -> bool:
    """An instance address of a 1.x worker: ``host:port/{id:x}/{ns}/{comp}/{ep}`` (the one rule, names.py's)."""
    return is_v1_tcp_address(address)


def split_v1_address(address: str) -> tuple[str, str]:
    """``host:port/{id:x}/{ns}/{comp}/{ep}`` -> (``host:port``, the path)."""
    m = _ADDRESS.match(address)
    if m is None:
        raise V1WireError(f"not a Dynamo 1.x request-plane address: {address!r}")
    return m.group("hostport"), m.group("path")


def v1_path(instance_id: int, namespace: str, component: str, endpoint: str) -> str:
    """The path a 1.x client names an endpoint of an instance by."""
    return f"{instance_id & 0xFFFFFFFFFFFFFFFF:x}/{namespace}/{component}/{endpoint}"


def parse_v1_path(path: str) -> tuple[int, str, str, str]:
    """(instance id, namespace, component, endpoint) of a 1.x path."""
    parts = path.split("/")
    if len(parts) != 4 or not all(parts):
        raise V1WireError(f"invalid endpoint path {path!r} (expected <instance hex>/<ns>/<comp>/<endpoint>)")
    try:
        instance_id = int(parts[0], 16)
    except ValueError:
        raise V1WireError(f"invalid endpoint path {path!r}: {parts[0]!r} is not an instance id in hex") from None
    return instance_id, parts[1], parts[2], parts[3]


# ---------------------------------------------------------------------------------- requests and acks


def encode_request_message(path: str, headers: dict[str, str], payload: bytes) -> bytes:
    """One request as a 1.x worker reads it."""
    p = path.encode()
    h = orjson.dumps(headers)
    if len(p) > 0xFFFF or len(h) > 0xFFFF:
        raise V1WireError("endpoint path or headers over 65535 bytes")
    if len(payload) > MAX_REQUEST:
        raise V1WireError(f"a request of {len(payload)} bytes (at most {MAX_REQUEST} accepted)")
    return b"".join((_pack_u16(len(p)), p, _pack_u16(len(h)), h, _pack_u32(len(payload)), payload))


def encode_ack(error: str | None = None) -> bytes:
    """The worker's answer to one request: empty (taken) or the refusal's text."""
    if not error:
        return _EMPTY_ACK
    data = error.encode()
    return _pack_u32(len(data)) + data


MAX_PATH = 1024  # a 1.x path is "{instance hex}/{ns}/{comp}/{ep}": far below this
_PATH_OK = re.compile(rb"[0-9a-f]{1,16}/[\x21-\x7e]+\Z")


class RequestDecoder:
    """Incremental decoder of 1.x requests: ``feed(bytes)`` -> [(path, headers, payload)] now complete.
    A payload announced over ``max_len`` raises at its length, before any of it is buffered; a path that is
    not one (empty, over :data:`MAX_PATH`, not ``{hex}/...`` in printable ASCII) raises as soon as its bytes
    are in, so a stranger's bytes (what the port's first two bytes took for a 1.x path length) drop the
    connection at once instead of holding it open waiting for a path that never ends."""

    __slots__ = ("_buf", "max_len")

    def __init__(self, max_len: int = MAX_REQUEST) -> None:
        self._buf = bytearray()
        self.max_len = max_len

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[str, dict[str, Any], bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[str, dict[str, Any], bytes]] = []
        pos = 0
        size = len(buf)
        while True:
            if size - pos < 2:
                break
            plen = _U16.unpack_from(buf, pos)[0]
            if not 0 < plen <= MAX_PATH:
                raise V1WireError(f"a request path of {plen} bytes announced (1 to {MAX_PATH} accepted)")
            hpos = pos + 2 + plen
            if size >= hpos and not _PATH_OK.match(bytes(buf[pos + 2:hpos])):
                raise V1WireError("a request path that is not {instance}/{namespace}/{component}/{endpoint}")
            if size - hpos < 2:
                break
            hlen = _U16.unpack_from(buf, hpos)[0]
            lpos = hpos + 2 + hlen
            if size - lpos < 4:
                break
            length = _U32.unpack_from(buf, lpos)[0]
            if length > self.max_len:
                raise V1WireError(f"a request of {length} bytes announced (at most {self.max_len} accepted)")
            end = lpos + 4 + length
            if end > size:
                break
            try:
                path = bytes(buf[pos + 2:hpos]).decode()
                headers = orjson.loads(bytes(buf[hpos + 2:lpos])) if hlen else {}
            except (UnicodeDecodeError, orjson.JSONDecodeError) as exc:
                raise V1WireError(f"undecodable request path or headers: {exc}") from None
            out.append((path, headers if isinstance(headers, dict) else {}, bytes(buf[lpos + 4:end])))
            pos = end
        if pos:
            del buf[:pos]
        return out


class AckDecoder:
    """Incremental decoder of a 1.x worker's acks: ``feed(bytes)`` -> [ack bytes] now complete."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        size = len(buf)
        while size - pos >= 4:
            length = _U32.unpack_from(buf, pos)[0]
            if length > MAX_REQUEST:
                raise V1WireError(f"an ack of {length} bytes announced")
            end = pos + 4 + length
            if end > size:
                break
            out.append(bytes(buf[pos + 4:end]))
            pos = end
        if pos:
            del buf[:pos]
        return out


# ---------------------------------------------------------------------------------- payloads


def request_codec(control: dict[str, Any]) -> str:
    """The codec of a request's body, from its control JSON: 1.x's default when the key is absent is JSON."""
    codec = control.get(CODEC_KEY)
    return codec if isinstance(codec, str) and codec else JSON


def decode_body(body: bytes, codec: str) -> Any:
    """A request body in ``codec`` (``msgpack`` or ``json``)."""
    if codec == MSGPACK:
        return msgpack_decode(body)
    if codec == JSON:
        return orjson.loads(body)
    raise V1WireError(f"unsupported payload codec {codec!r} (msgpack and json are)")


def _builtins(item: Any) -> Any:
    if type(item) is LazyJson:
        return orjson.loads(item.raw) if item.raw is not None else dict(item)
    return item


def encode_msgpack(obj: Any) -> bytes:
    """``obj`` (builtins, msgspec Structs, a LazyJson) as msgpack."""
    return _msgpack_encoder.encode(_builtins(obj))


def encode_msgpack_item(item: Any) -> bytes:
    """One stream item as a msgpack data frame: ``{"data": <Annotated>, "complete_final": false}``."""
    if isinstance(item, BareItem):  # 1.x's control endpoints: the item itself, no Annotated layer
        ann = _builtins(item.data())
    else:
        ann = item.to_dict() if isinstance(item, Annotated) else {"data": _builtins(item)}
    return encode_frame(body=_msgpack_encoder.encode({"data": ann, "complete_final": False}))


FRAME_COMPLETE_MSGPACK = encode_frame(body=_msgpack_encoder.encode({"complete_final": True}))


def encode_v1_request(request_id: str, connection_info: dict, body: bytes, codec: str = MSGPACK) -> bytes:
    """The two-part payload of a request to a 1.x worker: the control JSON with ``payload_codec``, and
    the body already in that codec."""
    control = {
        "id": request_id,
        "request_type": "single_in",
        "response_type": "many_out",
        CODEC_KEY: codec,
        "connection_info": {
            "transport": connection_info["transport"],
            "info": orjson.dumps(connection_info["info"]).decode(),
        },
    }
    return encode_frame(orjson.dumps(control), body)
