"""Multiplexed call-home between runtimes in this process (real etcd + NATS): many concurrent streams over
one connection, cancelling one of them, and the negotiation with a peer that calls home per stream."""

from __future__ import annotations

import asyncio

from dynamo.runtime import EngineError, StreamIncompleteError


async def paced(request):
    for i in range(request["n"]):
        await asyncio.sleep(0.002)
        yield {"s": request["s"], "i": i}


async def collect(stream):
    return [item async for item in stream]


async def test_many_concurrent_streams_share_one_connection(make_runtime, ns, serve):
    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), paced)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    n, items = 128, 40
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(client.generate({"s": s, "n": items})) for s in range(n))), 60)
    for s, got in enumerate(results):
        assert got == [{"s": s, "i": i} for i in range(items)]
    receiver = caller.response_streams().started_receiver
    assert len(receiver.mux_connections) == 1  # every stream came over the same connection
    (conn,) = receiver.mux_connections
    assert conn.streams == {} and receiver.pending == {} and receiver.mux_pending == {}
    assert worker.response_streams().mux_pool is not None and len(worker.response_streams().mux_pool._conns) == 1
    # the next burst reuses it
    await collect(client.generate({"s": 0, "n": 2}))
    assert receiver.mux_connections == {conn}


async def test_cancelling_one_multiplexed_stream_stops_only_its_handler(make_runtime, ns, serve):
    worker, caller = await make_runtime(), await make_runtime()
    outcomes: dict[int, str] = {}

    async def handler(request):
        try:
            for i in range(request["n"]):
                await asyncio.sleep(0.005)
                yield i
            outcomes[request["s"]] = "done"
        except BaseException as exc:  # GeneratorExit or CancelledError: the work stopped
            outcomes[request["s"]] = type(exc).__name__
            raise

    await serve(worker.namespace(ns).component("b").endpoint("g"), handler)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    doomed = client.generate({"s": 0, "n": 10_000})
    assert await doomed.__anext__() == 0
    others = [asyncio.create_task(collect(client.generate({"s": s, "n": 60}))) for s in (1, 2, 3)]
    await asyncio.sleep(0.05)
    await doomed.aclose()
    for task in others:
        assert await asyncio.wait_for(task, 30) == list(range(60))
    for _ in range(200):
        if 0 in outcomes:
            break
        await asyncio.sleep(0.01)
    assert outcomes.get(0) in ("GeneratorExit", "CancelledError")
    assert [outcomes[s] for s in (1, 2, 3)] == ["done"] * 3
    assert len(caller.response_streams().started_receiver.mux_connections) == 1


async def test_a_worker_that_does_not_multiplex_is_served_per_stream(make_runtime, ns, serve):
    """The client offers multiplexing; a worker that does not take it (DYN_TCP_MUX=0 here, the original
    Rust binary in the field) calls home per stream, and the client serves that as before."""
    worker, caller = await make_runtime(tcp_mux=False), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), paced)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    results = await asyncio.gather(*(collect(client.generate({"s": s, "n": 5})) for s in range(8)))
    assert results == [[{"s": s, "i": i} for i in range(5)] for s in range(8)]
    assert caller.response_streams().started_receiver.mux_connections == set() and caller.response_streams().started_receiver.mux_pending == {}
    assert worker.response_streams().mux_pool is None


async def test_a_client_that_does_not_offer_it_gets_per_stream_connections(make_runtime, ns, serve):
    worker, caller = await make_runtime(), await make_runtime(tcp_mux=False)
    await serve(worker.namespace(ns).component("b").endpoint("g"), paced)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    assert await collect(client.generate({"s": 1, "n": 3})) == [{"s": 1, "i": i} for i in range(3)]
    assert caller.response_streams().started_receiver.mux_connections == set()
    assert worker.response_streams().mux_pool is None


async def test_errors_and_worker_shutdown_over_a_multiplexed_connection(make_runtime, ns, serve):
    worker, caller = await make_runtime(graceful_shutdown_timeout=0.0), await make_runtime()

    async def handler(request):
        if request["mode"] == "fail":
            yield 1
            raise RuntimeError("boom")
        for i in range(100_000):
            await asyncio.sleep(0.01)
            yield i

    await serve(worker.namespace(ns).component("b").endpoint("g"), handler)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    failing = client.generate({"mode": "fail"})
    assert await failing.__anext__() == 1
    try:
        await failing.__anext__()
        raise AssertionError("no error item")
    except EngineError as exc:
        assert "boom" in str(exc)
    long = client.generate({"mode": "long"})
    assert await long.__anext__() == 0
    await worker.close()  # no grace period: the handler is cancelled, the stream ends incomplete
    try:
        await asyncio.wait_for(collect(long), 10)
        raise AssertionError("the stream ended cleanly")
    except StreamIncompleteError:
        pass


async def test_lazy_streams_pass_json_objects_on_undecoded(make_runtime, ns, serve):
    from dynamo.lazyjson import LazyJson
    from dynamo.runtime import Annotated

    async def handler(request):
        yield {"k": 1, "text": 'a "quoted" word'}
        yield [1, 2]
        yield "plain"
        yield Annotated(data={"k": 2}, event="note")

    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), handler)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    got = await collect(client.generate({}, lazy=True))
    assert got == [{"k": 1, "text": 'a "quoted" word'}, [1, 2], "plain", {"k": 2}]
    assert type(got[0]) is LazyJson and got[0].raw == b'{"k":1,"text":"a \\"quoted\\" word"}'
    assert type(got[3]) is dict  # an Annotated item keeps the ordinary frame
    plain = await collect(client.generate({}))
    assert plain == got and all(type(x) is not LazyJson for x in plain)
    annotated = await collect(client.generate({}, annotated=True))
    assert [a.data() for a in annotated] == got and annotated[3].event() == "note"
