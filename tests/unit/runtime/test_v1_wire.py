"""The TCP request plane (runtime/v1_wire.py), Dynamo 1.x's wire, against the bytes Dynamo 1.6.1 itself sent: a chat
request from its frontend to its mocker, the ack, and the call-home stream (data/dynamo161_request_plane.txt,
captured with tcpdump). We decode what 1.6.1 sends, and what we send is byte for byte what it sends."""

from __future__ import annotations

import ast
from pathlib import Path

import orjson
import pytest

from dynamo.llm.protocols.common import EngineOutput
from dynamo.llm.protocols.v1 import engine_output_from_v1, request_from_v1, usage, v1_output
from dynamo.runtime.codec import FrameDecoder, decode_frame
from dynamo.runtime.names import is_v1_tcp_address
from dynamo.runtime.tcp_connections import ack_result
from dynamo.runtime.transport import (
    CLIENT_KEY,
    CLIENT_OURS,
    FRAME_PROLOGUE_OK,
    FRAME_SENTINEL,
    encode_frame,
    encode_handshake,
    encode_request,
)
from dynamo.runtime.v1_wire import (
    FRAME_COMPLETE_MSGPACK,
    MSGPACK,
    AckDecoder,
    RequestDecoder,
    V1WireError,
    decode_body,
    encode_ack,
    encode_msgpack_item,
    encode_request_message,
    msgpack_decode,
    request_codec,
    split_v1_address,
    v1_path,
)

DATA = Path(__file__).with_name("data") / "dynamo161_request_plane.txt"
WORKER_PORT, CALLHOME_PORT = "43837", "46263"
PATH = "59f5a0430fd477b0/d16/backend/generate"


def records() -> list[tuple[str, str, bytes]]:
    lines = [ln for ln in DATA.read_text().splitlines() if not ln.startswith("#")]
    out = []
    for head, literal in zip(lines[::2], lines[1::2], strict=True):
        src, dst = head.split()[1].split("->")
        out.append((src, dst, ast.literal_eval(literal.strip())))
    return out


def request_bytes() -> bytes:
    return next(b for _, dst, b in records() if dst == WORKER_PORT)


def ack_bytes() -> bytes:
    return next(b for src, _, b in records() if src == WORKER_PORT)


def callhome_frames() -> list[tuple[bytes, bytes]]:
    stream = b"".join(b for _, dst, b in records() if dst == CALLHOME_PORT)
    return FrameDecoder().feed(stream)


def test_the_request_decodes_into_path_headers_control_and_a_msgpack_preprocessed_request():
    raw = request_bytes()
    [(path, headers, payload)] = RequestDecoder().feed(raw)
    assert path == PATH and headers["x-endpoint-path"] == PATH
    assert headers["request-id"] == "6522ce00-297b-48b8-92e9-d498fb352fe9"
    header, body = decode_frame(payload)
    control = orjson.loads(header)
    assert control["payload_codec"] == MSGPACK and request_codec(control) == MSGPACK
    assert control["connection_info"]["transport"] == "tcp_server"
    info = orjson.loads(control["connection_info"]["info"])
    assert info == {"address": "127.0.0.1:46263", "subject": "109f57c1-fe38-4e93-8236-909c77c08653",
                    "context": "6522ce00-297b-48b8-92e9-d498fb352fe9", "stream_type": "response"}
    request = decode_body(body, MSGPACK)
    assert request["model"] == "tiny-chat" and len(request["token_ids"]) == 25
    assert request["routing"] == {"dp_rank": 0}
    v1 = request_from_v1(request)
    req = v1.request
    assert req.token_ids == request["token_ids"] and req.model == "tiny-chat"
    assert req.stop_conditions.max_tokens == 3
    assert req.stop_conditions.stop_token_ids_hidden == [2, 0] and req.eos_token_ids == [2, 0]
    assert v1.visible_stop_ids == frozenset()
    assert path == v1_path(0x59F5A0430FD477B0, "d16", "backend", "generate")


def test_the_request_decodes_whatever_the_reads_cut_it_into_and_re_encodes_byte_for_byte():
    raw = request_bytes()
    decoder = RequestDecoder()
    got = []
    for i in range(len(raw)):  # one byte at a time, the worst a socket can do
        got += decoder.feed(raw[i:i + 1])
    [(path, headers, payload)] = got
    assert decoder.buffered == 0
    assert encode_request_message(path, headers, payload) == raw


def test_acks_and_what_a_client_makes_of_them():
    assert ack_bytes() == encode_ack() == b"\0\0\0\0"
    decoder = AckDecoder()
    both = encode_ack() + encode_ack("Server overloaded: worker at capacity")
    assert decoder.feed(both[:3]) == [] and decoder.feed(both[3:]) == [b"", b"Server overloaded: worker at capacity"]
    assert ack_result(b"", "a") == b""
    assert ack_result(b"Server overloaded: worker at capacity", "a") == b'{"error":"busy"}'
    with pytest.raises(Exception, match="unknown endpoint"):  # 1.6.1's words for "nothing served here"
        ack_result(b"Server unavailable: unknown endpoint 1/a/b/c", "a")


def test_the_call_home_stream_is_ours_with_msgpack_bodies():
    frames = callhome_frames()
    assert [h for h, b in frames[:2]] == [b'{"subject":"109f57c1-fe38-4e93-8236-909c77c08653","stream_type":"response"}',
                                          b'{"error":null}']
    assert encode_frame(header=frames[0][0]) == encode_handshake("109f57c1-fe38-4e93-8236-909c77c08653")
    assert encode_frame(header=frames[1][0]) == FRAME_PROLOGUE_OK
    items = [msgpack_decode(b) for h, b in frames[2:6]]
    assert all(i["complete_final"] is False and set(i) == {"data", "complete_final"} for i in items)
    outs = [engine_output_from_v1(i["data"]["data"]) for i in items]
    assert [o.token_ids for o in outs] == [[1676], [1182], [1755], []]
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]
    assert outs[0].cached_tokens == 0 and outs[0].text is None
    assert encode_frame(body=frames[6][1]) == FRAME_COMPLETE_MSGPACK
    assert encode_frame(header=frames[7][0]) == FRAME_SENTINEL


def test_our_items_are_byte_for_byte_what_1_6_1_sends():
    frames = callhome_frames()
    first = v1_output(EngineOutput(), [1676], None, usage(25, 1, 0))
    middle = v1_output(EngineOutput(), [1182], None, None)
    last = v1_output(EngineOutput(), [], "length", usage(25, 3, 0))
    assert encode_msgpack_item(first) == encode_frame(body=frames[2][1])
    assert encode_msgpack_item(middle) == encode_frame(body=frames[3][1])
    assert encode_msgpack_item(last) == encode_frame(body=frames[5][1])


def test_a_request_we_send_carries_what_1_6_1_sends_and_our_mark():
    conn = {"transport": "tcp_server", "info": {"address": "127.0.0.1:46263", "subject": "s", "context": "r",
                                                "stream_type": "response", "heartbeat_ms": 500}}
    header, body = decode_frame(encode_request("r", conn, b"{}"))
    control = orjson.loads(header)
    # 1.6.1's keys, no payload_codec (the body is JSON, 1.x's default), and our client's mark
    assert list(control) == ["id", "request_type", "response_type", "connection_info", CLIENT_KEY]
    assert control[CLIENT_KEY] == CLIENT_OURS and request_codec(control) == "json"
    assert orjson.loads(control["connection_info"]["info"]) == conn["info"] and body == b"{}"


def test_addresses():
    address = f"127.0.0.1:43837/{PATH}"
    assert is_v1_tcp_address(address) and split_v1_address(address) == ("127.0.0.1:43837", PATH)
    assert not is_v1_tcp_address("d16_backend.generate-59f5a0430fd477b0")  # a NATS subject
    assert v1_path(-1, "a", "b", "c") == "ffffffffffffffff/a/b/c"
    with pytest.raises(V1WireError, match="not a TCP request-plane address"):
        split_v1_address("127.0.0.1:43837/d16/backend")


def test_an_announced_request_over_the_limit_is_refused_at_its_length():
    decoder = RequestDecoder(max_len=100)
    with pytest.raises(V1WireError, match="101 bytes"):
        decoder.feed(b"\x00\x071/a/b/c\x00\x00" + (101).to_bytes(4, "big"))


@pytest.mark.parametrize("prefix", [
    b"\xff\xff",  # a path of 65535 bytes: no 1.x path is that long
    b"\x00\x04\x00\x01\x02\x03",  # a path of control bytes
    b"\x00\x05hello",  # no instance and no endpoint
])
def test_bytes_that_are_no_1x_path_are_refused_as_soon_as_they_are_in(prefix):
    """A stranger's bytes taken for a 1.x path length drop the connection at once (not a wait for more)."""
    with pytest.raises(V1WireError, match="path"):
        RequestDecoder().feed(prefix)
