"""Wire formats: frames, stream messages, the request envelope, Annotated, Instance records."""

import orjson
import pytest

from dynamo.runtime.annotated import Annotated
from dynamo.runtime.codec import FrameDecoder, FrameError, decode_frame, encode_frame
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.transport import (
    FRAME_COMPLETE,
    FRAME_SENTINEL,
    encode_error_item,
    encode_item,
    encode_request,
    parse_request_control,
)


def test_frame_layout():
    frame = encode_frame(b'{"a":1}', b"body")
    assert frame[:24] == (7).to_bytes(8, "big") + (4).to_bytes(8, "big") + bytes(8)
    assert decode_frame(frame) == (b'{"a":1}', b"body")


def test_decoder_handles_split_and_joined_frames():
    frames = [encode_frame(b"h1", b""), encode_frame(b"", b"body2"), encode_frame(b"h3", b"b3")]
    stream = b"".join(frames)
    dec = FrameDecoder()
    out = []
    for i in range(0, len(stream), 5):  # dribble it in
        out += dec.feed(stream[i:i + 5])
    assert out == [(b"h1", b""), (b"", b"body2"), (b"h3", b"b3")]
    assert FrameDecoder().feed(stream) == out
    for cut in range(1, len(stream)):  # whole frames then a partial one in a read, the rest in the next
        dec = FrameDecoder()
        assert dec.feed(stream[:cut]) + dec.feed(stream[cut:]) == out


def test_decode_rejects_bad_lengths():
    with pytest.raises(FrameError):
        decode_frame(encode_frame(b"h", b"b")[:-1])


def test_item_frames():
    header, body = decode_frame(encode_item({"token_ids": [1, 2]}))
    assert header == b""
    assert orjson.loads(body) == {"data": {"data": {"token_ids": [1, 2]}}, "complete_final": False}
    _, body = decode_frame(encode_item(Annotated(data=None, event="x", comment=["c"])))
    assert orjson.loads(body) == {"data": {"event": "x", "comment": ["c"]}, "complete_final": False}
    _, body = decode_frame(encode_error_item("boom"))
    assert orjson.loads(body)["data"] == {"event": "error", "comment": ["boom"]}
    assert decode_frame(FRAME_COMPLETE) == (b"", b'{"complete_final":true}')
    assert decode_frame(FRAME_SENTINEL) == (b'"sentinel"', b"")


def test_request_envelope():
    conn = {"transport": "tcp_server", "info": {"address": "1.2.3.4:5", "subject": "s", "context": "r",
                                                "stream_type": "response"}}
    header, body = decode_frame(encode_request("r", conn, b'{"x":1}'))
    control = orjson.loads(header)
    assert control["request_type"] == "single_in" and control["response_type"] == "many_out"
    assert isinstance(control["connection_info"]["info"], str)  # a JSON string, as the original
    assert parse_request_control(header) == ("r", "tcp_server", conn["info"])
    assert body == b'{"x":1}'


def test_annotated():
    a = Annotated.from_error("bad")
    assert a.is_error() and a.error_message() == "bad" and a.data() is None
    assert Annotated.from_dict({"data": 1, "id": "i"}).to_dict() == {"data": 1, "id": "i"}


def test_instance_record_format():
    """An endpoint served over NATS: 1.x's Endpoint record with its ``nats_tcp`` transport."""
    inst = Instance.for_endpoint(EndpointId("ns", "comp", "ep"), 0xABC)
    text = inst.to_json().decode()
    assert orjson.loads(text) == {"type": "Endpoint", "component": "comp", "endpoint": "ep", "namespace": "ns",
                                  "instance_id": 0xABC, "transport": {"nats_tcp": "ns_comp.ep-abc"},
                                  "device_type": "cpu", "request_plane_codec": "msgpack", "dynamo_py": True}
    assert Instance.from_json(text) == inst
