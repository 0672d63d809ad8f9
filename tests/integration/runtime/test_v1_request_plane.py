"""Our client and our worker on the one TCP request wire, Dynamo 1.x's (runtime/v1_wire.py), in this process,
on the file store: every endpoint's address is 1.x's (``host:port/{id:x}/{ns}/{comp}/{ep}``), our client
offers its extras (heartbeats, multiplexed call-home) and our worker honours them, while the request stays
one a 1.x worker would take. Stop, kill, a dead worker, an unknown endpoint and a busy worker come out as
1.6.1's words for them."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.runtime import DistributedRuntime, NoRespondersError, StreamIncompleteError, WorkerBusyError
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.probe import reachable
from dynamo.runtime.tcp_listener import TcpResponseServer
from dynamo.runtime.v1_wire import v1_path
from harness.wait import until


@pytest.fixture
def runtimes(file_runtimes):
    return lambda: file_runtimes(stream_liveness=2.0, graceful_shutdown_timeout=0.2)


async def with_path(worker: DistributedRuntime, caller: DistributedRuntime, ident: EndpointId, name: str) -> None:
    """Rewrite the worker's instance record to name another endpoint path on the same port."""
    key = ident.instance_key(worker.instance_id)
    ours = Instance.from_json((await caller.discovery().get(key)).value)
    hostport = ours.subject.partition("/")[0]
    path = v1_path(worker.instance_id, ident.namespace, ident.component, name)
    record = Instance(ident.namespace, ident.component, ident.name, worker.instance_id, f"{hostport}/{path}")
    await worker.discovery().put(key, record.to_json(), lease=True)


async def client_of(caller, ident: EndpointId, path_end: str | None = None):
    client = await caller.namespace(ident.namespace).component(ident.component).endpoint(ident.name).client()
    await client.wait_for_instances(5)
    if path_end:
        await until(lambda: all(i.subject.endswith(path_end) for i in client.instances()), 5, "the new record")
    return client


@pytest.mark.parametrize("secret", [None, b"the one-wire test's fleet secret"], ids=["open", "fleet-secret"])
async def test_a_client_streams_from_our_worker_on_the_one_wire_with_our_extras(file_runtimes, serve, secret):
    worker, caller = [await file_runtimes(stream_liveness=2.0, fleet_secret=secret) for _ in range(2)]
    seen: list[dict] = []

    async def gen(request, context):
        seen.append(request)
        for i in range(request["n"]):
            yield {"i": i, "blob": b"\x01\x02".hex()}

    ident = EndpointId("v1t", "backend", "generate")
    await serve(worker.namespace("v1t").component("backend").endpoint("generate"), gen)
    client = await client_of(caller, ident)
    assert client.instances()[0].subject.split("/", 1)[1] == v1_path(worker.instance_id, "v1t", "backend",
                                                                     "generate")
    items = [x async for x in client.round_robin({"n": 3, "token_ids": [1, 2, 300000]})]
    assert [x["i"] for x in items] == [0, 1, 2]
    assert seen == [{"n": 3, "token_ids": [1, 2, 300000]}]
    # the extras offered were honoured: the worker called home multiplexed, with heartbeats
    receiver = caller.response_streams().started_receiver
    assert isinstance(receiver, TcpResponseServer) and receiver.mux_connections
    # a probe: our worker says it answers over the response path, and does
    assert await reachable(caller.request_plane(), receiver, client.instances()[0].subject, worker.instance_id, 2)
    # many at once over the one connection: acks come back in order
    many = await asyncio.gather(*[_collect(client.round_robin({"n": 2})) for _ in range(20)])
    assert all([x["i"] for x in m] == [0, 1] for m in many)


async def _collect(stream) -> list:
    return [x async for x in stream]


async def test_kill_from_a_leaving_consumer_and_a_dead_worker(runtimes, serve):
    worker, caller = await runtimes(), await runtimes()
    cancelled = asyncio.Event()

    async def endless(request):
        try:
            i = 0
            while True:
                yield {"i": i}
                i += 1
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, GeneratorExit):
            cancelled.set()
            raise

    ident = EndpointId("v1k", "backend", "generate")
    await serve(worker.namespace("v1k").component("backend").endpoint("generate"), endless)
    client = await client_of(caller, ident)
    stream = client.round_robin({})
    assert (await stream.__anext__())["i"] == 0
    await stream.aclose()  # sends "kill" on the call-home connection
    await asyncio.wait_for(cancelled.wait(), 5)

    stream = client.round_robin({})
    assert (await stream.__anext__())["i"] == 0
    # the worker shuts down mid-stream: its drain gives up on the endless stream after 0.2 s and ends it
    # without the completion marker (a 1.x client knows no "drained" item): incomplete, so it migrates
    await worker.close()
    with pytest.raises(StreamIncompleteError):
        async for _ in stream:
            pass


async def test_an_unknown_endpoint_is_no_responders_and_a_full_worker_is_busy(runtimes, serve):
    worker, caller = await runtimes(), await runtimes()
    release = asyncio.Event()

    async def held(request):
        yield {"started": True}
        await release.wait()

    ident = EndpointId("v1b", "backend", "generate")
    await serve(worker.namespace("v1b").component("backend").endpoint("generate"), held, max_inflight=1)
    await with_path(worker, caller, ident, "nothing-here")
    client = await client_of(caller, ident, "/nothing-here")
    with pytest.raises(NoRespondersError, match="nothing-here"):  # 1.6.1's "unknown endpoint" refusal
        await client.round_robin({}).start()

    await with_path(worker, caller, ident, "generate")
    client = await client_of(caller, ident, "/generate")
    await until(lambda: bool(client.instance_ids()), 5, "an instance")
    first = client.round_robin({})
    assert await first.__anext__() == {"started": True}
    with pytest.raises(WorkerBusyError):
        await client.direct({}, worker.instance_id).start()
    release.set()


async def test_a_request_a_byte_at_a_time_and_an_unknown_path(runtimes, serve):
    """A request trickling in one byte per write is acked once whole; a path that names no endpoint here
    gets 1.6.1's refusal text."""
    from dynamo.runtime.transport import encode_request
    from dynamo.runtime.v1_wire import AckDecoder, encode_request_message

    worker = await runtimes()

    async def gen(request):
        yield {"ok": True}

    ident = EndpointId("v1s", "backend", "generate")
    await serve(worker.namespace("v1s").component("backend").endpoint("generate"), gen)
    ours = Instance.from_json((await worker.discovery().get(ident.instance_key(worker.instance_id))).value)
    host, _, port = ours.subject.partition("/")[0].rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = {"transport": "tcp_server", "info": {"address": "127.0.0.1:9", "subject": "s", "context": "r",
                                                "stream_type": "response"}}
    unknown = encode_request_message(v1_path(worker.instance_id, "v1s", "backend", "nope"), {},
                                     encode_request("r", conn, b"{}"))
    for i in range(len(unknown)):
        writer.write(unknown[i:i + 1])
        await writer.drain()
    acks = AckDecoder()
    got: list[bytes] = []
    while not got:
        got = acks.feed(await asyncio.wait_for(reader.read(100), 5))
    path = v1_path(worker.instance_id, "v1s", "backend", "nope")
    assert got == [f"Server unavailable: unknown endpoint {path}".encode()]
    writer.close()


async def test_a_client_with_a_fleet_secret_refuses_a_1x_worker_in_one_line(file_runtimes):
    """A 1.x worker has no fleet secret (its call-home would be refused here): the request fails at once,
    naming why, not at the deadline of a handshake it cannot answer."""
    caller = await file_runtimes(stream_liveness=2.0, fleet_secret=b"the one-wire test's fleet secret")
    ident = EndpointId("v1f", "backend", "generate")
    iid = 0x59F5A0430FD477B0
    # a 1.x worker's record (its Endpoint does not say it is ours)
    record = Instance(ident.namespace, ident.component, ident.name, iid,
                      f"127.0.0.1:9/{v1_path(iid, ident.namespace, ident.component, ident.name)}", ours=False)
    await caller.discovery().put(ident.instance_key(iid), record.to_json(), lease=True)
    client = await client_of(caller, ident)
    with pytest.raises(NoRespondersError) as info:
        await client.round_robin({}).start()
    assert "Dynamo 1.x worker" in str(info.value) and "DYN_FLEET_SECRET" in str(info.value)
    assert "\n" not in str(info.value)
