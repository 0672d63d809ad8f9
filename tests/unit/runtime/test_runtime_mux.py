"""Multiplexed call-home (runtime/mux.py): the envelope format, and a client listener and a worker's
connection pool talking over real loopback sockets (no etcd or NATS needed): demultiplexing, a stream's
cancel leaving the shared connection up, per-stream back-pressure, liveness, per-stream fallback."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from dynamo.runtime.codec import FrameError, encode_frame
from dynamo.runtime.context import Context
from dynamo.runtime.errors import StreamIncompleteError, StreamStalledError
from dynamo.runtime.mux import (
    INFO_KEY,
    EnvelopeDecoder,
    envelope,
    split_frames,
)
from dynamo.runtime.mux_callhome import MuxPool
from dynamo.runtime.tcp_callhome import TcpSink
from dynamo.runtime.tcp_listener import TcpResponseServer
from dynamo.runtime.transport import FRAME_COMPLETE, FRAME_PROLOGUE_OK, FRAME_SENTINEL, StreamState, encode_item

FRAME_PROLOGUE = FRAME_PROLOGUE_OK


def test_envelope_layout_and_decoder_handles_split_and_joined_envelopes():
    a = envelope(7, encode_item({"x": 1}))
    assert a[:16] == (7).to_bytes(8, "big") + (len(a) - 16).to_bytes(8, "big")
    stream = a + envelope(0, encode_frame(b'"heartbeat"')) + envelope(2**40, FRAME_COMPLETE + FRAME_SENTINEL)
    expected = EnvelopeDecoder().feed(stream)
    assert [sid for sid, _ in expected] == [7, 0, 2**40]
    for cut in range(1, len(stream)):
        dec = EnvelopeDecoder()
        assert dec.feed(stream[:cut]) + dec.feed(stream[cut:]) == expected
    dec = EnvelopeDecoder()
    out = []
    for i in range(0, len(stream), 3):
        out += dec.feed(stream[i:i + 3])
    assert out == expected
    assert split_frames(expected[2][1]) == [(b"", b'{"complete_final":true}'), (b'"sentinel"', b"")]


def test_envelope_errors():
    with pytest.raises(FrameError):
        EnvelopeDecoder().feed((1).to_bytes(8, "big") + (2**40).to_bytes(8, "big"))
    with pytest.raises(FrameError):
        split_frames(encode_item({"x": 1})[:-3])  # an envelope must hold whole frames


# ---------------------------------------------------------------------------------- over loopback


class Pair:
    """A client listener and a worker-side pool, plus helpers to open streams between them."""

    def __init__(self, liveness: float = 5.0) -> None:
        self.server = TcpResponseServer("127.0.0.1", liveness)
        self.pool = MuxPool()

    async def __aenter__(self) -> "Pair":
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.pool.close()
        await self.server.close()

    async def open(self) -> tuple[StreamState, object, Context]:
        state = StreamState(f"r{id(object())}", 1)
        conn_info = self.server.register(state)
        state.on_finish = self.server.unregister
        info = conn_info["info"]
        context = Context(state.request_id)
        conn = await self.pool.get(info["address"], info["heartbeat_ms"])
        return state, conn.open(info[INFO_KEY], context), context


async def drain_items(state: StreamState) -> list:
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(state.next_raw(), 5))
        except StopAsyncIteration:
            return out


async def test_many_streams_share_one_connection_and_each_gets_its_own_items():
    async with Pair() as p:
        streams = [await p.open() for _ in range(20)]
        assert len(p.pool._conns) == 1
        for i, (_, sink, _) in enumerate(streams):
            sink.send_prologue()
            for j in range(5):
                sink.write(encode_item({"s": i, "j": j}))
            sink.finish()
        results = await asyncio.gather(*(drain_items(state) for state, _, _ in streams))
        for i, items in enumerate(results):
            assert items == [{"data": {"s": i, "j": j}} for j in range(5)]
        assert len(p.server.mux_connections) == 1
        assert p.server.pending == {} and p.server.mux_pending == {}
        (conn,) = p.server.mux_connections
        assert conn.streams == {}  # every stream forgotten at its sentinel


async def test_a_turn_of_writes_from_all_streams_leaves_in_one_send():
    async with Pair() as p:
        streams = [await p.open() for _ in range(3)]
        conn = next(iter(p.pool._conns.values()))
        writes = []
        real_write = conn.transport.write
        conn.transport.write = lambda data: (writes.append(data), real_write(data))  # type: ignore[method-assign]
        for _, sink, _ in streams:
            sink.send_prologue()
            sink.write(encode_item({"t": 1}))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(writes) == 1
        for state, _, _ in streams:
            assert await asyncio.wait_for(state.next_raw(), 5) == {"data": {"t": 1}}


async def test_a_kill_ends_one_stream_and_the_connection_carries_on():
    async with Pair() as p:
        (s1, k1, c1), (s2, k2, c2) = await p.open(), await p.open()
        k1.send_prologue()
        k2.send_prologue()
        k1.write(encode_item(1))
        k2.write(encode_item(2))
        assert await asyncio.wait_for(s1.next_raw(), 5) == {"data": 1}
        killed = asyncio.Event()
        c1.add_callback(lambda kind: killed.set() if kind == "kill" else None)
        s1.send_control("kill")  # what ResponseStream does when its consumer goes away
        await asyncio.wait_for(killed.wait(), 5)
        assert not c2.is_stopped()
        k1.write(encode_item(99))  # already on its way when the kill arrived: dropped by the client
        k1.abort()
        k2.write(encode_item(3))
        k2.finish()
        assert await drain_items(s2) == [{"data": 2}, {"data": 3}]
        (conn,) = p.server.mux_connections
        await asyncio.sleep(0.05)
        assert conn.streams == {} and conn.transport is not None and not conn.transport.is_closing()
        s3, k3, _ = await p.open()  # the same connection serves the next stream
        assert len(p.pool._conns) == 1
        k3.send_prologue()
        k3.finish()
        assert await drain_items(s3) == []


async def test_stop_reaches_only_its_stream():
    async with Pair() as p:
        (s1, k1, c1), (_, k2, c2) = await p.open(), await p.open()
        stopped = asyncio.Event()
        c1.add_callback(lambda kind: stopped.set())
        s1.send_control("stop")  # before the stream's first frame: held until it is known
        k1.send_prologue()
        k2.send_prologue()
        await asyncio.wait_for(stopped.wait(), 5)
        assert c1.is_stopped() and not c1.is_killed() and not c2.is_stopped()


async def test_an_aborted_stream_is_incomplete_for_the_client():
    async with Pair() as p:
        state, sink, _ = await p.open()
        sink.send_prologue()
        sink.write(encode_item("a"))
        sink.abort()
        assert await asyncio.wait_for(state.next_raw(), 5) == {"data": "a"}
        with pytest.raises(StreamIncompleteError):
            await asyncio.wait_for(state.next_raw(), 5)


async def test_frames_for_a_withdrawn_stream_get_it_killed():
    async with Pair() as p:
        state, sink, context = await p.open()
        state.fail(StreamStalledError())  # e.g. not acked in time: the client withdrew the stream
        killed = asyncio.Event()
        context.add_callback(lambda kind: killed.set() if kind == "kill" else None)
        sink.send_prologue()
        await asyncio.wait_for(killed.wait(), 5)


async def test_one_slow_consumer_pauses_only_its_stream():
    async with Pair() as p:
        (slow, k_slow, _), (fast, k_fast, _) = await p.open(), await p.open()
        k_slow.send_prologue()
        k_fast.send_prologue()
        for i in range(StreamState.HIGH_WATER + 10):
            k_slow.write(encode_item(i))
        k_fast.write(encode_item("f"))
        assert await asyncio.wait_for(fast.next_raw(), 5) == {"data": "f"}
        # the client asks the worker to hold the slow stream; the other one is not held
        for _ in range(100):
            if k_slow.must_drain:
                break
            await asyncio.sleep(0.01)
        assert k_slow.must_drain and not k_fast.must_drain
        assert len(slow.items) <= StreamState.HIGH_WATER + 10
        drained = asyncio.create_task(k_slow.drain())
        await asyncio.sleep(0.05)
        assert not drained.done()
        k_fast.write(encode_item("g"))  # the shared connection still delivers
        assert await asyncio.wait_for(fast.next_raw(), 5) == {"data": "g"}
        got = 0
        while len(slow.items) >= StreamState.LOW_WATER:  # the consumer catches up: resume is sent
            await slow.next_raw()
            got += 1
        await slow.next_raw()
        await asyncio.wait_for(drained, 5)
        assert not k_slow.must_drain


async def test_a_silent_connection_fails_all_its_streams_as_stalled():
    async with Pair(liveness=0.3) as p:
        state, sink, context = await p.open()
        sink.send_prologue()
        conn = next(iter(p.pool._conns.values()))
        conn._beat.cancel()  # a frozen worker sends no heartbeats
        with pytest.raises(StreamStalledError):
            await asyncio.wait_for(drain_items(state), 5)
        for _ in range(100):  # the client closed the connection: the worker's handler is told
            if context.is_killed():
                break
            await asyncio.sleep(0.01)
        assert context.is_killed()


async def test_heartbeats_keep_an_idle_multiplexed_stream_alive():
    async with Pair(liveness=0.3) as p:
        state, sink, _ = await p.open()
        sink.send_prologue()
        await asyncio.sleep(1.0)  # more than three liveness bounds with no item
        sink.write(encode_item("late"))
        sink.finish()
        assert await drain_items(state) == [{"data": "late"}]


async def test_the_client_listener_still_takes_per_stream_call_homes():
    """A worker that does not know multiplexing (the original) ignores mux_stream and calls home per
    stream with the subject; the same listener serves it."""
    async with Pair() as p:
        state = StreamState("r1", 1)
        info = p.server.register(state)["info"]
        assert INFO_KEY in info and info["subject"]
        sink = await TcpSink.connect(info, Context("r1"))
        sink.send_prologue()
        sink.write(encode_item({"k": 1}))
        sink.finish()
        assert await drain_items(state) == [{"data": {"k": 1}}]
        assert p.server.mux_pending == {} and p.server.mux_connections == set()


async def test_a_connection_closed_by_the_worker_fails_its_streams_at_once():
    async with Pair() as p:
        (s1, k1, _), (s2, _, _) = await p.open(), await p.open()
        k1.send_prologue()
        await asyncio.wait_for(_until(lambda: s1.connected), 5)
        p.pool.close()  # what a killed worker's kernel does
        with pytest.raises(StreamIncompleteError):
            await asyncio.wait_for(drain_items(s1), 5)
        assert not s2.connected  # never started: left to the call-home deadline, as per-stream


async def _until(cond) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 5 s")


def test_handshake_is_ordinary_frame_json():
    from dynamo.runtime.mux import encode_mux_handshake

    frame = encode_mux_handshake(1000)
    assert orjson.loads(frame[24:]) == {"stream_type": "mux", "mux": 1, "heartbeat_ms": 1000}


class _FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class _FakeServer:
    def __init__(self, states: dict[int, StreamState]) -> None:
        self.states = states
        self.mux_connections: set = set()
        self.pending_bytes = 0

    def take_mux(self, sid: int) -> StreamState | None:
        return self.states.pop(sid, None)


def test_demultiplexing_any_split_of_the_byte_stream():
    from dynamo.runtime.mux_listener import MuxClientProtocol

    def wire() -> bytes:
        return (envelope(1, FRAME_PROLOGUE + encode_item("a1")) + envelope(2, FRAME_PROLOGUE)
                + envelope(0, encode_frame(b'"heartbeat"')) + envelope(2, encode_item("b1") + encode_item("b2"))
                + envelope(1, encode_item("a2") + FRAME_COMPLETE + FRAME_SENTINEL)
                + envelope(3, encode_item("x")) + envelope(2, FRAME_SENTINEL))

    data = wire()
    for step in (1, 7, 16, 23, len(data)):
        s1, s2 = StreamState("1", 1), StreamState("2", 1)
        transport = _FakeTransport()
        proto = MuxClientProtocol(_FakeServer({1: s1, 2: s2}), transport)  # type: ignore[arg-type]
        for i in range(0, len(data), step):
            proto.data_received(data[i:i + step])
        assert list(s1.items) == [{"data": "a1"}, {"data": "a2"}] and s1.finished and s1.error is None
        assert list(s2.items) == [{"data": "b1"}, {"data": "b2"}] and isinstance(s2.error, StreamIncompleteError)  # aborted
        # stream 3 is not ours: a kill goes back for it, the connection stays
        assert transport.written == [envelope(3, encode_frame(b'"kill"'))] and not transport.closed
        assert proto.streams == {3: None}


def test_a_garbled_envelope_closes_the_connection_and_fails_its_streams():
    from dynamo.runtime.mux_listener import MuxClientProtocol

    s1 = StreamState("1", 1)
    transport = _FakeTransport()
    proto = MuxClientProtocol(_FakeServer({1: s1}), transport)  # type: ignore[arg-type]
    proto.data_received(envelope(1, FRAME_PROLOGUE + b"\x00" * 30))
    assert transport.closed
    proto.connection_lost(None)
    assert isinstance(s1.error, StreamIncompleteError)


def test_plain_items_travel_as_their_own_json():
    from dynamo.runtime.annotated import Annotated
    from dynamo.runtime.mux import encode_plain_item
    from dynamo.runtime.mux_listener import MuxClientProtocol

    assert encode_plain_item({"a": 1})[24:] == b'"item"{"a":1}'
    assert encode_plain_item(Annotated(data=1, event="e")) == encode_item(Annotated(data=1, event="e"))
    s1 = StreamState("1", 1)
    proto = MuxClientProtocol(_FakeServer({1: s1}), _FakeTransport())  # type: ignore[arg-type]
    proto.data_received(envelope(1, FRAME_PROLOGUE + encode_plain_item({"a": 1}) + encode_plain_item("x")
                                 + encode_plain_item(Annotated(data=2, event="e"))))
    assert list(s1.items) == [b'{"a":1}', b'"x"', {"data": 2, "event": "e"}]  # decoded by the consumer
