"""The event plane (Dynamo 1.x's, the only one) on the wire: the envelope, its frames, subjects and discovery records.

Facts observed from Dynamo 1.6.1's own processes (tcpdump, and their discovery files), so that its
frontends read our workers' events and ours read its workers':

* Every event is an **EventEnvelope**, MessagePack, a map in this order: ``publisher_id`` (u64),
  ``sequence`` (u64, per publisher, from 0), ``published_at`` (ms since the epoch), ``topic`` (str),
  ``payload`` (bin: the topic's own MessagePack).
* **ZMQ**: one PUB socket per publisher and topic, four frames per event: the topic, the publisher id and
  the sequence as u64 big-endian, then a 5-byte header (version 1, u32 big-endian length) and the
  envelope.  Subscribers filter on the topic frame.
* **NATS**: the bare envelope (no header) on ``namespace.<ns>.component.<comp>.endpoint.<ep>.<topic>``.
* Discovery: each publisher is an ``EventChannel`` record under
  ``v1/event_channels/namespace/<ns>/component/<comp>/endpoint/<ep>/topic/<topic>/<publisher_id:x>``
  saying where it is; a publisher whose consumers must be able to recover a lost stream also writes an
  ``EventSource`` record (same key under ``v1/event_sources``) whose ``metadata`` the consumer
  interprets (the KV router's: :mod:`dynamo.kv.v1_events`).  Publisher ids are random and kept below
  2**53 so that JSON readers that hold numbers as doubles read them exactly, as 1.6.1 does.

Nothing here does I/O (:mod:`.event_channels` moves the bytes); all of it is pinned by tests against
the bytes 1.6.1 sent (tests/unit/runtime/test_v1_event_wire.py).
"""

from __future__ import annotations

import random
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from . import v1_records

FRAME_VERSION = 1
_HEADER = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
MAX_JSON_SAFE_ID = (1 << 53) - 1
EVENT_CHANNELS = v1_records.EVENT_CHANNELS + "/"
EVENT_SOURCES = v1_records.EVENT_SOURCES + "/"


class WireError(ValueError):
    """Bytes that are not a Dynamo 1.x event."""


class Envelope(msgspec.Struct):
    """One event as 1.x sends it (field order is the wire's map order)."""

    publisher_id: int
    sequence: int
    published_at: int
    topic: str
    payload: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


@dataclass(frozen=True, slots=True)
class EndpointScope:
    """The endpoint a 1.x event stream belongs to (1.6.1 scopes KV events and load to the worker's
    serving endpoint, e.g. ``ns.backend.generate``)."""

    namespace: str
    component: str
    endpoint: str

    @property
    def subject_prefix(self) -> str:
        return f"namespace.{self.namespace}.component.{self.component}.endpoint.{self.endpoint}"

    def subject(self, topic: str) -> str:
        """The NATS subject of ``topic`` in this scope."""
        return f"{self.subject_prefix}.{topic}"

    def key_prefix(self, bucket: str, topic: str) -> str:
        """Where the records of ``topic``'s publishers in this scope are (``bucket``: EVENT_CHANNELS or
        EVENT_SOURCES), ending in ``/``."""
        return (f"{bucket}namespace/{self.namespace}/component/{self.component}/endpoint/{self.endpoint}"
                f"/topic/{topic}/")

    def key(self, bucket: str, topic: str, publisher_id: int) -> str:
        return f"{self.key_prefix(bucket, topic)}{publisher_id:x}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "endpoint",
                "endpoint": {"namespace": self.namespace, "component": self.component, "name": self.endpoint}}


def new_publisher_id() -> int:
    """A random publisher id that JSON readers holding numbers as doubles read exactly (never 0)."""
    return random.getrandbits(53) or 1


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def encode_envelope(publisher_id: int, sequence: int, topic: str, payload: bytes,
                    published_at: int | None = None) -> bytes:
    """The MessagePack envelope (what NATS carries as is)."""
    env = Envelope(publisher_id, sequence, now_ms() if published_at is None else published_at, topic, payload)
    return _encoder.encode(env)


def decode_envelope(data: bytes | memoryview) -> Envelope:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a 1.x event envelope: {e}") from None


def zmq_frames(publisher_id: int, sequence: int, topic: str, payload: bytes,
               published_at: int | None = None) -> list[bytes]:
    """The four frames of one event on a 1.x ZMQ PUB socket."""
    body = encode_envelope(publisher_id, sequence, topic, payload, published_at)
    return [topic.encode(), _U64.pack(publisher_id), _U64.pack(sequence), _HEADER.pack(FRAME_VERSION, len(body)) + body]


def decode_zmq_frames(frames: list[bytes] | list[Any]) -> Envelope:
    """The envelope of a four-frame 1.x message; raises :class:`WireError` when it is not one."""
    if len(frames) != 4:
        raise WireError(f"a 1.x event has 4 frames, this one {len(frames)}")
    framed = bytes(frames[3])
    if len(framed) < _HEADER.size:
        raise WireError("the envelope frame is shorter than its header")
    version, length = _HEADER.unpack_from(framed)
    if version != FRAME_VERSION:
        raise WireError(f"unknown frame version {version} (1.x sends {FRAME_VERSION})")
    if length != len(framed) - _HEADER.size:
        raise WireError(f"the frame header says {length} bytes, {len(framed) - _HEADER.size} came")
    env = decode_envelope(memoryview(framed)[_HEADER.size:])
    if len(frames[1]) != 8 or _U64.unpack(bytes(frames[1]))[0] != env.publisher_id:
        raise WireError("the publisher frame does not match the envelope")
    return env


# -- discovery records ----------------------------------------------------------------------------------

def zmq_channel_record(scope: EndpointScope, topic: str, publisher_id: int, address: str) -> bytes:
    """The ``EventChannel`` record of a ZMQ publisher bound at ``address`` (``tcp://host:port``)."""
    return orjson.dumps({"type": "EventChannel", "scope": scope.to_json(), "topic": topic,
                         "instance_id": publisher_id,
                         "transport": {"kind": "Zmq", "config": {"endpoint": address}}})


def nats_channel_record(scope: EndpointScope, topic: str, publisher_id: int) -> bytes:
    """The ``EventChannel`` record of a publisher on NATS (the subject is the scope's prefix + topic)."""
    return orjson.dumps({"type": "EventChannel", "scope": scope.to_json(), "topic": topic,
                         "instance_id": publisher_id,
                         "transport": {"kind": "Nats", "config": {"subject_prefix": scope.subject_prefix}}})


def source_record(scope: EndpointScope, topic: str, publisher_id: int, metadata: dict[str, Any]) -> bytes:
    """The ``EventSource`` record: what a consumer needs to recover ``topic``'s stream from this publisher."""
    return orjson.dumps({"type": "EventSource", "scope": scope.to_json(), "topic": topic,
                         "publisher_id": publisher_id, "metadata": metadata})


@dataclass(frozen=True, slots=True)
class Channel:
    """A publisher, read from its ``EventChannel`` record: where to connect (ZMQ) or subscribe (NATS)."""

    publisher_id: int
    topic: str
    kind: str  # "zmq" | "nats"
    address: str  # tcp://host:port for ZMQ, the subject prefix for NATS


def parse_channel(value: bytes | str) -> Channel:
    """An ``EventChannel`` record; raises :class:`WireError` when it is not one we can follow."""
    try:
        rec = orjson.loads(value)
        if rec.get("type") != "EventChannel":
            raise WireError(f"not an EventChannel record (type {rec.get('type')!r})")
        transport = rec["transport"]
        kind = str(transport["kind"]).lower()
        config = transport["config"]
        if kind == "zmq":
            address = str(config["endpoint"])
        elif kind == "nats":
            address = str(config["subject_prefix"])
        else:
            raise WireError(f"event transport {transport['kind']!r} is not followed (only Zmq and Nats)")
        publisher_id = rec["instance_id"]
        if isinstance(publisher_id, bool) or not isinstance(publisher_id, int):
            raise WireError(f"instance_id must be an integer, got {publisher_id!r}")
        return Channel(publisher_id, str(rec["topic"]), kind, address)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise WireError(f"not an EventChannel record: {e}") from None
