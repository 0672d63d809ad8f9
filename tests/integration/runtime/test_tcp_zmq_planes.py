"""The TCP request plane and the event plane over ZMQ between runtimes in this process, with a real etcd and no
NATS server at all (``NATS_SERVER`` points at a closed port): requests, acks, no responders, busy, a
frozen listener, and events to subscribers that join before or after the publisher. A NATS-plane client
reaching a TCP worker is here too (that one with the session's nats-server)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynamo.runtime import AckTimeoutError, NoRespondersError
from dynamo.runtime.config import NatsSettings
from dynamo.runtime.ingress import Ingress
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.v1_event_wire import EndpointScope
from dynamo.runtime.v1_wire import RequestDecoder, encode_ack, v1_path
from harness.servers import free_port
from harness.wait import until

LIVENESS = 0.4


def closed_nats() -> NatsSettings:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return NatsSettings(f"nats://127.0.0.1:{port}", explicit=False)  # as if NATS_SERVER were not set


@pytest.fixture
def no_nats_runtime(make_runtime):
    """``await no_nats_runtime(**overrides)``: a runtime whose NATS_SERVER answers nothing."""
    async def make(**overrides):
        return await make_runtime(nats=closed_nats(), **overrides)
    return make


async def collect(stream) -> list:
    return [x async for x in stream]


async def test_without_nats_the_runtime_chooses_tcp_and_zmq_and_serves(no_nats_runtime, ns, serve, caplog):
    caplog.set_level("INFO", logger="dynamo.runtime.distributed")
    workers = [await no_nats_runtime(), await no_nats_runtime()]
    caller = await no_nats_runtime()
    assert caller.nats is None
    assert "request plane tcp, event plane zmq (no NATS at nats://127.0.0.1:" in caplog.text
    assert "object store etcd" in caplog.text

    def handler_of(rt):
        async def gen(request):
            for i in range(request["n"]):
                yield {"i": i, "by": rt.instance_id}
        return gen

    for rt in workers:
        await serve(rt.namespace(ns).component("b").endpoint("g"), handler_of(rt))
    key = EndpointId(ns, "b", "g").instance_key(workers[0].instance_id)
    record = Instance.from_json((await caller.discovery().get(key)).value)
    # one address shape for every TCP endpoint, ours and 1.x's: host:port/{instance_id:x}/{ns}/{comp}/{ep}
    assert record.subject.split("/", 1)[1] == v1_path(workers[0].instance_id, ns, "b", "g")

    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    while len(client.instance_ids()) < 2:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    seen = []
    for _ in range(4):
        items = await collect(client.round_robin({"n": 3}))
        assert [x["i"] for x in items] == [0, 1, 2]
        seen.append(items[0]["by"])
    assert seen[0] != seen[1] and seen[:2] == seen[2:]  # round-robin over both workers


async def test_a_stopped_endpoint_and_a_gone_worker_are_no_responders(no_nats_runtime, ns, serve):
    worker = await no_nats_runtime()
    caller = await no_nats_runtime(stream_liveness=LIVENESS)

    async def gen(request):
        yield {"ok": True}

    task = await serve(worker.namespace(ns).component("b").endpoint("g"), gen)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    assert await collect(client.round_robin({})) == [{"ok": True}]
    inst = client.instances()[0]
    # the listener is up but nothing is served under that name any more: "no responders", at once
    plane = worker.request_plane()
    name = inst.subject.split("/", 1)[1]  # the endpoint's path on the worker's port
    handler = plane.handlers.pop(name)  # type: ignore[attr-defined]
    with pytest.raises(NoRespondersError) as info:
        await client.direct({}, worker.instance_id).start()
    assert not isinstance(info.value, AckTimeoutError)
    plane.handlers[name] = handler  # type: ignore[attr-defined]
    # the whole process gone (its listener closed, its key still there): "no responders" too
    await plane.close()
    client._down.clear()
    client._recompute()
    with pytest.raises(NoRespondersError) as info:
        await client.direct({}, worker.instance_id).start()
    assert not isinstance(info.value, AckTimeoutError)
    task.cancel()


async def test_a_worker_at_its_limit_refuses_as_busy_over_tcp(no_nats_runtime, ns, at_its_limit):
    caller = await no_nats_runtime()
    busy = await at_its_limit(await no_nats_runtime(), caller, ns)
    assert await caller.request_plane().send(busy.client.instances()[0].subject, b"", 2) == b""  # a ping
    assert await busy.finish() == [{"done": True}]


async def test_a_listener_that_never_acks_is_set_aside_until_it_answers(no_nats_runtime, ns):
    """A frozen worker's kernel still accepts the connection; only the missing ack tells."""
    caller = await no_nats_runtime(stream_liveness=LIVENESS)
    answering = asyncio.Event()
    served = []

    async def handler(request):
        served.append(request)
        return
        yield

    thawed = Ingress(handler, name="thawed")  # what a worker that came back answers pings and probes with

    class Request:  # one request as the TCP plane hands it to a worker's Ingress
        def __init__(self, data: bytes, writer: asyncio.StreamWriter) -> None:
            self.data, self.writer = data, writer

        async def respond(self, data: bytes = b"") -> None:
            self.writer.write(encode_ack(data.decode() if data else None))

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = RequestDecoder()
        await answering.wait()  # frozen: its kernel holds what comes; thawed, it acks all of it in order
        while data := await reader.read(65536):
            for _path, _headers, payload in decoder.feed(data):
                await thawed.on_request(Request(payload, writer))

    server = await asyncio.start_server(frozen, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fake = 0x5EED
    ep = EndpointId(ns, "b", "g")
    inst = Instance.for_endpoint(ep, fake, f"127.0.0.1:{port}/{v1_path(fake, ns, 'b', 'g')}")
    await caller.discovery().put(ep.instance_key(fake), inst.to_json())
    try:
        client = await caller.namespace(ns).component("b").endpoint("g").client()
        assert await client.wait_for_instances(5) == [fake]
        with pytest.raises(AckTimeoutError):
            await client.round_robin({}).start()
        assert client.instance_ids() == []  # set aside
        answering.set()
        assert await client.wait_for_instances(5) == [fake]  # a ping got its answer
        await until(lambda: served, 5, "the request sent while it was frozen served")
        assert served == [{}]  # that one; a ping runs no handler
    finally:
        await caller.discovery().delete(ep.instance_key(fake))
        server.close()


async def test_a_nats_plane_client_reaches_a_tcp_worker(make_runtime, no_nats_runtime, ns, serve, caplog):
    """Each instance record names its plane: a process on NATS sends to a TCP worker directly, and follows
    its ZMQ publishers (each channel record says where); the worker, without NATS, cannot hear the other's
    NATS publishers, and each says so in one line."""
    caplog.set_level("WARNING", logger="dynamo.runtime.plane_choice")
    worker = await no_nats_runtime()
    caller = await make_runtime(request_plane="nats", event_plane="nats")

    async def gen(request):
        yield {"ok": True}

    await serve(worker.namespace(ns).component("b").endpoint("g"), gen)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    assert await collect(client.round_robin({})) == [{"ok": True}]
    for me, other in ((caller, worker), (worker, caller)):
        mine, theirs = ("nats", "zmq") if me is caller else ("zmq", "nats")
        line = f"event plane: this process uses {mine} and instance {other.instance_hex} uses {theirs}"
        await until(lambda: line in caplog.text, 5, line)  # noqa: B023 - awaited within the iteration
    assert f"request plane: instance {caller.instance_hex} and this process cannot reach each other" in caplog.text
    got: asyncio.Queue = asyncio.Queue()
    scope = EndpointScope(ns, "b", "g")
    await caller.event_plane().subscribe(scope, "kv_metrics", lambda env: got.put_nowait(env.payload))
    await published_until(await worker.event_plane().publisher(scope, "kv_metrics"), got, b"heard")
    assert await got.get() == b"heard"


async def test_a_fixed_tcp_rpc_port_is_the_address_in_discovery(no_nats_runtime, ns, serve):
    port = free_port()
    worker = await no_nats_runtime(tcp_rpc_port=port, tcp_host="127.0.0.1")

    async def gen(request):
        yield 1

    await serve(worker.namespace(ns).component("b").endpoint("g"), gen)
    kv = await worker.discovery().get(EndpointId(ns, "b", "g").instance_key(worker.instance_id))
    assert Instance.from_json(kv.value).subject.startswith(f"127.0.0.1:{port}/")


# -- the event plane over ZMQ -------------------------------------------------------------------------


async def published_until(pub, got: asyncio.Queue, payload: bytes) -> None:
    """Publish until the subscriber has one (its connection's handshake may still be under way)."""
    async with asyncio.timeout(10):
        while got.empty():
            sent = pub.publish(payload)  # NATS: a coroutine; ZMQ: sent at once (None)
            if sent is not None:
                await sent
            await asyncio.sleep(0.02)


async def test_zmq_events_reach_subscribers_that_join_before_and_after_the_publisher(no_nats_runtime, ns):
    early = await no_nats_runtime()
    publisher = await no_nats_runtime()
    scope = EndpointScope(ns, "backend", "generate")
    got_early: asyncio.Queue = asyncio.Queue()
    got_other: asyncio.Queue = asyncio.Queue()

    await early.event_plane().subscribe(scope, "kv_metrics", lambda env: got_early.put_nowait(env))
    other = await early.event_plane().subscribe(scope, "kv_metrics_other", lambda env: got_other.put_nowait(env))
    pub = await publisher.event_plane().publisher(scope, "kv_metrics")
    await published_until(pub, got_early, b"one")
    env = await got_early.get()
    assert (env.topic, env.payload, env.publisher_id) == ("kv_metrics", b"one", pub.publisher_id)
    assert got_other.empty()  # "kv_metrics_other" is another topic, not a prefix match
    await other.unsubscribe()

    late = await no_nats_runtime()  # starts after the publisher: finds it in discovery
    got_late: asyncio.Queue = asyncio.Queue()
    before = late.event_plane().reconnects
    await late.event_plane().subscribe(scope, "kv_metrics", lambda env: got_late.put_nowait(env.payload))
    await published_until(pub, got_late, b"two")
    assert await got_late.get() == b"two"
    assert late.event_plane().reconnects > before  # the handshake: the cue to ask for snapshots

    # a publisher that joins later still (a worker started after the frontend)
    newcomer = await no_nats_runtime()
    while not got_late.empty():
        got_late.get_nowait()
    await published_until(await newcomer.event_plane().publisher(scope, "kv_metrics"), got_late, b"three")
    assert await got_late.get() == b"three"
