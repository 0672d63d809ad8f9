"""Our client and our worker on Dynamo 1.x's TCP request plane (runtime/v1_wire.py), in this process,
on the file store: the worker's one port takes 1.x's framing beside ours, and a client whose instance
record has a 1.x address (``host:port/{id:x}/{ns}/{comp}/{ep}``, as 1.x workers register) sends in
1.x's framing with msgpack bodies and reads the msgpack call-home stream. Stop, kill, a dead worker, an
unknown endpoint and a busy worker come out as over our own wire."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.runtime import DistributedRuntime, NoRespondersError, StreamIncompleteError, WorkerBusyError
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.v1_wire import v1_path
from harness.wait import until


@pytest.fixture
def runtimes(file_runtimes):
    return lambda: file_runtimes(stream_liveness=2.0, graceful_shutdown_timeout=0.2)


async def as_v1_worker(worker: DistributedRuntime, caller: DistributedRuntime, ident: EndpointId,
                       name: str | None = None) -> None:
    """Rewrite the worker's instance record with a 1.x address for the same port, as a 1.x worker's."""
    key = ident.instance_key(worker.instance_id)
    ours = Instance.from_json((await caller.discovery().get(key)).value)
    hostport = ours.subject.partition("://")[2 if "://" in ours.subject else 0].partition("/")[0]
    path = v1_path(worker.instance_id, ident.namespace, ident.component, name or ident.name)
    record = Instance(ident.namespace, ident.component, ident.name, worker.instance_id, f"{hostport}/{path}")
    await worker.discovery().put(key, record.to_json(), lease=True)


async def v1_client(caller, ident: EndpointId):
    client = await caller.namespace(ident.namespace).component(ident.component).endpoint(ident.name).client()
    await client.wait_for_instances(5)
    await until(lambda: all("://" not in i.subject for i in client.instances()), 5, "the 1.x record")
    return client


async def test_a_client_streams_from_our_worker_over_the_1x_wire(runtimes, serve):
    worker, caller = await runtimes(), await runtimes()
    seen: list[dict] = []

    async def gen(request, context):
        seen.append(request)
        for i in range(request["n"]):
            yield {"i": i, "blob": b"\x01\x02".hex()}

    ident = EndpointId("v1t", "backend", "generate")
    await serve(worker.namespace("v1t").component("backend").endpoint("generate"), gen)
    await as_v1_worker(worker, caller, ident)
    client = await v1_client(caller, ident)
    items = [x async for x in client.round_robin({"n": 3, "token_ids": [1, 2, 300000]})]
    assert [x["i"] for x in items] == [0, 1, 2]
    assert seen == [{"n": 3, "token_ids": [1, 2, 300000]}]
    # many at once over the one connection: acks come back in order
    many = await asyncio.gather(*[_collect(client.round_robin({"n": 2})) for _ in range(20)])
    assert all([x["i"] for x in m] == [0, 1] for m in many)
    # our own clients keep our wire with the same worker (its record back to ours)
    seen.clear()
    plain = await worker.namespace("v1t").component("other").endpoint("generate").client()
    await serve(worker.namespace("v1t").component("other").endpoint("generate"), gen)
    await plain.wait_for_instances(5)
    assert [x["i"] async for x in plain.round_robin({"n": 1})] == [0] and seen == [{"n": 1}]


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
    await as_v1_worker(worker, caller, ident)
    client = await v1_client(caller, ident)
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
    await as_v1_worker(worker, caller, ident, name="nothing-here")
    client = await v1_client(caller, ident)
    with pytest.raises(NoRespondersError, match="nothing-here"):
        await client.round_robin({}).start()

    await as_v1_worker(worker, caller, ident)
    client = await v1_client(caller, ident)
    await until(lambda: bool(client.instance_ids()), 5, "an instance")
    first = client.round_robin({})
    assert await first.__anext__() == {"started": True}
    with pytest.raises(WorkerBusyError):
        await client.direct({}, worker.instance_id).start()
    release.set()


async def test_the_port_tells_1x_from_ours_even_a_byte_at_a_time(runtimes, serve):
    """A 1.x request trickling in one byte per write: the worker waits for the second byte to tell the wires
    apart, then acks it; a path that names no endpoint here gets 1.6.1's refusal text."""
    from dynamo.runtime.transport import encode_request
    from dynamo.runtime.v1_wire import AckDecoder, encode_request_message

    worker = await runtimes()

    async def gen(request):
        yield {"ok": True}

    ident = EndpointId("v1s", "backend", "generate")
    await serve(worker.namespace("v1s").component("backend").endpoint("generate"), gen)
    ours = Instance.from_json((await worker.discovery().get(ident.instance_key(worker.instance_id))).value)
    host, _, port = ours.subject.partition("://")[2].partition("/")[0].rpartition(":")
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
    assert got == [f"Unknown endpoint: {v1_path(worker.instance_id, 'v1s', 'backend', 'nope')}".encode()]
    writer.close()
