"""The TCP request plane's bytes: Dynamo 1.x's, the one request wire of the fleet, spoken by our clients and
workers to each other and to Dynamo 1.6.1's (docs/runtime.md, "The TCP request plane: one wire, 1.x's").
Its connections are :mod:`.tcp_connections`.

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

Our extras ride on it as fields a 1.x peer ignores (observed with 1.6.1's mocker): the control JSON's
``x_client`` (:data:`~.transport.CLIENT_KEY`) and ``probe``, the connection_info's ``heartbeat_ms`` and
``mux_stream``; a fleet secret's hello (:mod:`.fleet_auth`) comes before the first request.
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

MSGPACK = "msgpack"
JSON = "json"
CODEC_KEY = "payload_codec"  # in the control JSON: the body's codec (absent: JSON)
MAX_REQUEST = 32 * 1024 * 1024  # 1.x's DYN_TCP_MAX_MESSAGE_SIZE default, and ours
# 1.6.1's own refusals (the text of a non-empty ack), so a 1.x client reads ours as it reads its own
ACK_OVERLOADED = "Server overloaded: worker at capacity"
ACK_UNAVAILABLE = "Server unavailable: instance shutting down"
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_pack_u16 = _U16.pack
_pack_u32 = _U32.pack
_EMPTY_ACK = _pack_u32(0)
# host:port/{id:x}/{ns}/{comp}/{ep}: an endpoint's TCP address (a v1/instances record's "tcp" transport)
_ADDRESS = re.compile(r"^(?P<hostport>[^/]+:\d+)/(?P<path>[0-9a-f]{1,16}/[^/]+/[^/]+/[^/]+)$")

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
msgpack_decode = _msgpack_decoder.decode


class V1WireError(ValueError):
    """Bytes that are not the TCP request plane's (or exceed its limits)."""


def split_v1_address(address: str) -> tuple[str, str]:
    """``host:port/{id:x}/{ns}/{comp}/{ep}`` -> (``host:port``, the path)."""
    m = _ADDRESS.match(address)
    if m is None:
        raise V1WireError(f"not a TCP request-plane address: {address!r}")
    return m.group("hostport"), m.group("path")


def v1_path(instance_id: int, namespace: str, component: str, endpoint: str) -> str:
    """The path a client names an endpoint of an instance by on its process's port."""
    return f"{instance_id & 0xFFFFFFFFFFFFFFFF:x}/{namespace}/{component}/{endpoint}"


# ---------------------------------------------------------------------------------- requests and acks


def encode_request_message(path: str, headers: dict[str, str], payload: bytes) -> bytes:
    """One request message."""
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


MAX_PATH = 1024  # a path is "{instance hex}/{ns}/{comp}/{ep}": far below this
_PATH_OK = re.compile(rb"[0-9a-f]{1,16}/[\x21-\x7e]+\Z")


class RequestDecoder:
    """Incremental decoder of request messages: ``feed(bytes)`` -> [(path, headers, payload)] now complete.
    A payload announced over ``max_len`` raises at its length, before any of it is buffered; a path that is
    not one (empty, over :data:`MAX_PATH`, not ``{hex}/...`` in printable ASCII) raises as soon as its bytes
    are in, so a stranger's bytes (read as a path length) drop the
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
    """Incremental decoder of a worker's acks: ``feed(bytes)`` -> [ack bytes] now complete."""

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


