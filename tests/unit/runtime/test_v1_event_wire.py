"""The 1.x event plane's envelope and frames, against the bytes Dynamo 1.6.1 sent (data/dynamo16_events.json:
its mocker's kv-events and kv_metrics messages off the wire, its NATS kv_metrics message)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.runtime.v1_event_wire import (
    EVENT_CHANNELS,
    EVENT_SOURCES,
    MAX_JSON_SAFE_ID,
    EndpointScope,
    WireError,
    decode_envelope,
    decode_zmq_frames,
    encode_envelope,
    nats_channel_record,
    new_publisher_id,
    parse_channel,
    zmq_channel_record,
    zmq_frames,
)

DATA = json.loads((Path(__file__).parent / "data" / "dynamo16_events.json").read_text())


def frames(name: str) -> list[bytes]:
    return [bytes.fromhex(f) for f in DATA[name]]


@pytest.mark.parametrize("name, topic", [("kv_events_frames", "kv-events"), ("kv_metrics_frames", "kv_metrics")])
def test_decodes_and_reencodes_1x_zmq_messages_byte_for_byte(name: str, topic: str) -> None:
    wire = frames(name)
    env = decode_zmq_frames(wire)
    assert env.topic == topic and wire[0] == topic.encode()
    # we write exactly what 1.6.1 wrote: same map order, same integer widths, same header
    assert zmq_frames(env.publisher_id, env.sequence, env.topic, env.payload, env.published_at) == wire


def test_decodes_and_reencodes_1x_nats_message() -> None:
    msg = DATA["nats_kv_metrics"]
    data = bytes.fromhex(msg["data"])
    env = decode_envelope(data)
    assert env.topic == "kv_metrics" and msg["subject"].endswith(".kv_metrics")
    assert encode_envelope(env.publisher_id, env.sequence, env.topic, env.payload, env.published_at) == data


def test_subjects_and_keys_are_1x_s() -> None:
    scope = EndpointScope("d16", "backend", "generate")
    assert scope.subject("kv-events") == "namespace.d16.component.backend.endpoint.generate.kv-events"
    assert DATA["nats_kv_metrics"]["subject"] == EndpointScope("evA", "backend", "generate").subject("kv_metrics")
    assert scope.key(EVENT_CHANNELS, "kv-events", 0xF7E912C2C7EF6) == \
        "v1/event_channels/namespace/d16/component/backend/endpoint/generate/topic/kv-events/f7e912c2c7ef6"
    assert scope.key(EVENT_SOURCES, "kv-events", 1).startswith("v1/event_sources/namespace/d16/")
    assert scope.key(EVENT_CHANNELS, "kv-events", 0x9dc60b4175ba5) == \
        "v1/event_channels/namespace/d16/component/backend/endpoint/generate/topic/kv-events/9dc60b4175ba5"


def test_channel_records_round_trip_and_read_1x_s() -> None:
    scope = EndpointScope("d16", "backend", "generate")
    # as 1.6.1 wrote them (FACTS: its file store)
    theirs = ('{"type":"EventChannel","scope":{"kind":"endpoint","endpoint":{"namespace":"d16","component":"backend",'
              '"name":"generate"}},"topic":"kv-events","instance_id":4361286627131126,"transport":{"kind":"Zmq",'
              '"config":{"endpoint":"tcp://127.0.0.1:39481"}}}')
    assert zmq_channel_record(scope, "kv-events", 4361286627131126, "tcp://127.0.0.1:39481") == theirs.encode()
    ch = parse_channel(theirs)
    assert (ch.publisher_id, ch.topic, ch.kind, ch.address) == (4361286627131126, "kv-events", "zmq",
                                                                 "tcp://127.0.0.1:39481")
    nats = parse_channel(nats_channel_record(scope, "kv_metrics", 7))
    assert (nats.kind, nats.address) == ("nats", "namespace.d16.component.backend.endpoint.generate")


def test_bad_input_is_a_wire_error() -> None:
    wire = frames("kv_events_frames")
    with pytest.raises(WireError, match="4 frames"):
        decode_zmq_frames(wire[:3])
    with pytest.raises(WireError, match="version"):
        decode_zmq_frames([*wire[:3], b"\x02" + wire[3][1:]])
    with pytest.raises(WireError, match="header says"):
        decode_zmq_frames([*wire[:3], wire[3][:-1]])
    with pytest.raises(WireError, match="publisher frame"):
        decode_zmq_frames([wire[0], b"\0" * 8, wire[2], wire[3]])
    with pytest.raises(WireError):
        parse_channel(b'{"type":"EventChannel","transport":{"kind":"ZmqBroker","config":{}}}')
    with pytest.raises(WireError):
        parse_channel(b"not json")


def test_publisher_ids_fit_a_double() -> None:
    assert all(0 < new_publisher_id() <= MAX_JSON_SAFE_ID for _ in range(100))


def test_a_bare_item_is_sent_as_1x_sends_its_recovery_answer() -> None:
    """1.6.1's mocker answered a recovery query with ``{"data": {"TreeDump": ...}, "complete_final": false}``:
    no Annotated layer.  A BareItem of the same answer is those bytes exactly; any other item keeps the
    layer (1.x's LLM endpoints have it)."""
    import msgspec

    from dynamo.runtime.annotated import BareItem
    from dynamo.runtime.codec import decode_frame
    from dynamo.runtime.v1_wire import encode_msgpack_item

    theirs = bytes.fromhex(DATA["recovery_tree_dump_item"])
    answer = msgspec.msgpack.decode(theirs)["data"]
    assert decode_frame(encode_msgpack_item(BareItem(answer))) == (b"", theirs)
    wrapped = msgspec.msgpack.decode(decode_frame(encode_msgpack_item(answer))[1])
    assert wrapped["data"] == {"data": answer}
