"""Serving and calling endpoints between runtimes in this process (real etcd + NATS)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamo.runtime import (
    Annotated,
    DistributedRuntime,
    EngineError,
    InstanceNotFoundError,
    NoInstancesError,
    NoRespondersError,
    RuntimeConnectionError,
    WorkerDrainedError,
)
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from harness.wait import until

# "tcp": multiplexed call-home (our default); "tcp-per-stream": a connection per stream (the original's
# protocol, DYN_TCP_MUX=0 on the caller); "nats": NATS response streams
TRANSPORTS = ["tcp", "tcp-per-stream", "nats"]


def caller_settings(transport: str) -> dict:
    if transport == "tcp-per-stream":
        return {"response_transport": "tcp", "tcp_mux": False}
    return {"response_transport": transport}


async def echo(request):
    for i in range(request.get("n", 3)):
        yield {"i": i, "echo": request.get("text")}


async def collect(stream):
    return [item async for item in stream]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_echo_all_client_modes(make_runtime, ns, serve, transport):
    worker = await make_runtime()
    caller = await make_runtime(**caller_settings(transport))
    endpoint = worker.namespace(ns).component("backend").endpoint("generate")
    await endpoint.component.create_service()
    await serve(endpoint, echo)

    client = await caller.namespace(ns).component("backend").endpoint("generate").client()
    assert await client.wait_for_instances(5) == [worker.instance_id]
    assert client.instance_ids() == [endpoint.lease_id()]
    expected = [{"i": 0, "echo": "hi"}, {"i": 1, "echo": "hi"}]
    req = {"n": 2, "text": "hi"}
    assert await collect(client.random(req)) == expected
    assert await collect(client.round_robin(req)) == expected
    assert await collect(client.direct(req, worker.instance_id)) == expected
    assert await collect(client.generate(req)) == expected
    assert await collect(await client.generate(req)) == expected  # the original binding's await style
    annotated = await collect(client.generate(req, annotated=True))
    assert all(isinstance(a, Annotated) for a in annotated) and annotated[0].data() == expected[0]


async def test_instance_record_and_subject(make_runtime, ns, serve):
    worker = await make_runtime()
    endpoint = worker.namespace(ns).component("Back End").endpoint("gen")
    await serve(endpoint, echo)
    hex_id = f"{worker.instance_id:x}"
    kv = await worker.etcd.get(f"v1/instances/{ns}/Back End/gen/{hex_id}")
    assert kv is not None and kv.lease == worker.instance_id
    inst = Instance.from_json(kv.value)
    assert inst.subject == f"{ns.lower()}_back_end.gen-{hex_id}"
    assert inst.instance_id == worker.instance_id


async def test_round_robin_spreads_over_two_instances(make_runtime, ns, serve):
    seen = []

    def handler_for(name):
        async def handler(request):
            seen.append(name)
            yield {"worker": name}
        return handler

    w1, w2 = await make_runtime(), await make_runtime()
    await serve(w1.namespace(ns).component("b").endpoint("g"), handler_for("w1"))
    await serve(w2.namespace(ns).component("b").endpoint("g"), handler_for("w2"))
    caller = await make_runtime()
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await until(lambda: len(client.instance_ids()) == 2, 5, "both instances")
    assert sorted(client.instance_ids()) == sorted([w1.instance_id, w2.instance_id])
    answers = [(await collect(client.round_robin({})))[0]["worker"] for _ in range(6)]
    assert answers.count("w1") == 3 and answers.count("w2") == 3
    assert answers[0] != answers[1]  # alternates
    direct = await collect(client.direct({}, w2.instance_id))
    assert direct == [{"worker": "w2"}]


async def test_handler_exception_becomes_error_and_worker_keeps_serving(make_runtime, ns, serve):
    async def flaky(request):
        yield {"ok": 1}
        if request.get("fail"):
            raise RuntimeError("engine exploded")
        yield {"ok": 2}

    async def fails_at_start(request):
        raise KeyError("bad request")
        yield  # pragma: no cover

    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), flaky)
    await serve(worker.namespace(ns).component("b").endpoint("g2"), fails_at_start)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    got = []
    with pytest.raises(EngineError, match="engine exploded"):
        async for item in client.generate({"fail": True}):
            got.append(item)
    assert got == [{"ok": 1}]
    with pytest.raises(ValueError):  # EngineError is a ValueError, as in the original binding
        await collect(client.generate({"fail": True}))
    assert await collect(client.generate({})) == [{"ok": 1}, {"ok": 2}]
    client2 = await caller.namespace(ns).component("b").endpoint("g2").client()
    await client2.wait_for_instances(5)
    with pytest.raises(EngineError, match="bad request"):
        await collect(client2.generate({}))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["aclose", "break", "cancel"])
async def test_client_cancel_stops_handler(make_runtime, ns, serve, transport, how):
    outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    async def endless(request):
        i = 0
        try:
            while True:
                yield {"i": i}
                i += 1
                await asyncio.sleep(0.01)
        except BaseException as exc:  # GeneratorExit or CancelledError: the work is stopped
            if not outcome.done():
                outcome.set_result(type(exc).__name__)
            raise

    worker, caller = await make_runtime(), await make_runtime(**caller_settings(transport))
    await serve(worker.namespace(ns).component("b").endpoint("g"), endless)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)

    if how == "aclose":
        stream = client.generate({})
        assert await stream.__anext__() == {"i": 0}
        await stream.aclose()
    elif how == "break":
        async def consume():
            async for item in client.generate({}):
                if item["i"] == 2:
                    break
        await consume()  # the stream object is dropped with the frame: GC sends the kill
    else:
        started = asyncio.Event()

        async def consume():
            async for _ in client.generate({}):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await asyncio.wait_for(outcome, 5) in ("GeneratorExit", "CancelledError")


async def test_context_handler_sees_stop(make_runtime, ns, serve):
    observed = {}

    async def polite(request, context):
        observed["id"] = context.id()
        i = 0
        while not context.is_stopped():
            yield {"i": i}
            i += 1
            await asyncio.sleep(0.01)
        observed["stopped"] = context.is_stopped()
        observed["killed"] = context.is_killed()
        yield {"final": True}

    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), polite)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    stream = client.generate({})
    items = []
    async for item in stream:
        items.append(item)
        if len(items) == 3:
            stream.stop_generating()
    assert items[-1] == {"final": True}
    assert observed["stopped"] is True and observed["killed"] is False
    assert observed["id"] == stream.id()


async def test_concurrent_streams(make_runtime, ns, serve):
    async def slow_echo(request):
        for i in range(request["n"]):
            await asyncio.sleep(0)
            yield {"i": i}

    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), slow_echo)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    results = await asyncio.gather(*[collect(client.round_robin({"n": 100})) for _ in range(64)])
    assert all([r["i"] for r in res] == list(range(100)) for res in results)


async def test_no_instances_and_unknown_instance(make_runtime, ns, serve):
    caller = await make_runtime()
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    with pytest.raises(NoInstancesError) as err:
        await collect(client.round_robin({}))
    assert str(err.value) == f'no instances found for endpoint "v1/instances/{ns}/b/g"'
    with pytest.raises(InstanceNotFoundError, match=f'instance_id=42 not found for endpoint "v1/instances/{ns}/b/g"'):
        await collect(client.direct({}, 42))
    with pytest.raises(asyncio.TimeoutError):
        await client.wait_for_instances(timeout=0.2)


async def test_no_responders_marks_instance_down(make_runtime, ns, serve):
    """An instance key whose subject nobody serves (a worker that just died): NoRespondersError."""
    caller = await make_runtime()
    ep = EndpointId(ns, "b", "g")
    ghost_id = caller.instance_id  # any lease works; use ours so the key is cleaned up with it
    await caller.etcd.put(ep.instance_key(ghost_id), Instance.for_endpoint(ep, ghost_id).to_json(), lease=True)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    assert await client.wait_for_instances(5) == [ghost_id]
    with pytest.raises(NoRespondersError) as err:
        await collect(client.generate({}))
    assert err.value.instance_id == ghost_id
    assert client.instance_ids() == []  # down until it answers a ping (it never will) or a watch update
    with pytest.raises(NoInstancesError):
        await collect(client.generate({}))


async def test_watch_follows_instances_coming_and_going(make_runtime, ns, serve):
    caller = await make_runtime()
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    assert client.instance_ids() == []
    worker = await make_runtime()
    task = await serve(worker.namespace(ns).component("b").endpoint("g"), echo)
    assert await client.wait_for_instances(5) == [worker.instance_id]
    worker.shutdown()
    await asyncio.wait_for(task, 10)
    await until(lambda: not client.instance_ids(), 5, "the instance gone from the client")


async def test_graceful_shutdown_deregisters_then_finishes_inflight(make_runtime, ns, serve):
    release = asyncio.Event()

    async def slow(request):
        yield {"i": 0}
        await release.wait()  # in flight until the test has seen the deregistration
        for i in range(1, 10):
            yield {"i": i}

    worker, caller = await make_runtime(), await make_runtime()
    serving = await serve(worker.namespace(ns).component("b").endpoint("g"), slow)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    stream = client.generate({})
    first = await stream.__anext__()
    worker.shutdown()
    # deregistered at once ...
    async def deregistered() -> bool:
        return await caller.etcd.get_prefix(f"v1/instances/{ns}/") == []

    await until(deregistered, 5, "the instance key gone")
    assert not serving.done()  # ... while the in-flight request still runs
    release.set()
    rest = [item async for item in stream]
    assert [first] + rest == [{"i": i} for i in range(10)]
    await asyncio.wait_for(serving, 5)


@pytest.mark.parametrize("mux", [True, False], ids=["multiplexed", "connection-per-stream"])
async def test_a_drain_that_times_out_hands_the_stream_back(make_runtime, ns, serve, mux):
    async def endless(request):
        for i in range(100_000):
            await asyncio.sleep(0.01)
            yield {"i": i}

    worker = await make_runtime(graceful_shutdown_timeout=0.3, tcp_mux=mux)
    caller = await make_runtime(tcp_mux=mux)
    serving = await serve(worker.namespace(ns).component("b").endpoint("g"), endless)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    stream = client.generate({})
    got = [await stream.__anext__()]
    worker.shutdown()
    with pytest.raises(WorkerDrainedError):  # not a plain StreamIncompleteError: the worker said why
        async for item in stream:
            got.append(item)
    # it kept streaming through the drain timeout, in order, then handed the stream back
    assert got == [{"i": i} for i in range(len(got))] and len(got) > 5
    await asyncio.wait_for(serving, 5)


async def test_static_mode(make_runtime, ns, serve):
    worker = await make_runtime(static=True)
    caller = await make_runtime(static=True)
    assert worker.etcd is None and worker.instance_id == 0
    endpoint = worker.namespace(ns).component("b").endpoint("g")
    assert endpoint.subject == f"{ns}_b.g"
    await serve(endpoint, echo)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    assert client.instance_ids() == [0]
    assert await collect(client.generate({"n": 2, "text": "s"})) == [{"i": 0, "echo": "s"}, {"i": 1, "echo": "s"}]


async def test_unreachable_servers_fail_fast(runtime_servers):
    good_etcd = EtcdSettings([runtime_servers.etcd.url])
    good_nats = NatsSettings(runtime_servers.nats.url)
    start = time.monotonic()
    with pytest.raises(RuntimeConnectionError) as err:
        await DistributedRuntime.connect(RuntimeSettings(etcd=EtcdSettings(["http://127.0.0.1:1"]), nats=good_nats))
    assert str(err.value) == "cannot reach etcd at http://127.0.0.1:1: connection refused"
    for planes in ({"request_plane": "nats"}, {"event_plane": "nats"}):  # NATS asked for: it must answer
        with pytest.raises(RuntimeConnectionError) as err:
            await DistributedRuntime.connect(RuntimeSettings(etcd=good_etcd, nats=NatsSettings("nats://127.0.0.1:1"),
                                                             **planes))
        assert str(err.value) == "cannot reach NATS at nats://127.0.0.1:1: connection refused"
    assert time.monotonic() - start < 6


async def test_nats_pubsub_and_object_store(make_runtime, ns):
    """What the LLM layer builds on: plain pub/sub for events, JetStream object store for model files."""
    rt = await make_runtime()
    component = rt.namespace(ns).component("backend")
    subject = component.event_subject("kv_events")
    assert subject == f"namespace.{ns}.component.backend.kv_events"
    sub = await rt.nats.subscribe(subject)
    await rt.nats.publish(subject, b'{"event": 1}')
    msg = await sub.next_msg(timeout=5)
    assert msg.data == b'{"event": 1}'
    js = rt.nats.jetstream()
    store = await js.create_object_store(f"{ns}-bucket")
    await store.put("tokenizer.json", b"{}")
    assert (await store.get("tokenizer.json")).data == b"{}"
    await js.delete_object_store(f"{ns}-bucket")


async def test_constructor_then_start(runtime_env):
    """``DistributedRuntime(loop, False)`` as in the original binding, then ``await rt.start()``."""
    rt = DistributedRuntime(asyncio.get_running_loop(), False)
    await rt.start()
    try:
        assert rt.instance_id > 0 and rt.instance_hex == f"{rt.instance_id:x}"
        assert await rt.etcd.create(f"probe/{rt.instance_hex}", {"a": 1}, lease=True)
    finally:
        await rt.close()


async def test_lease_bound_entry_seen_by_watcher_and_removed_on_close(make_runtime, ns):
    """The pattern for model entries: written with the primary lease, watched by a frontend."""
    frontend = await make_runtime()
    worker = await make_runtime()
    watch = await frontend.etcd.watch_prefix(f"{ns}/models")
    try:
        assert watch.initial == []
        key = f"{ns}/models/{worker.instance_hex}"
        assert await worker.etcd.create(key, {"name": "m"}, lease=True) is True
        ev = await asyncio.wait_for(watch.__anext__(), 5)
        assert (ev.kind, ev.key, ev.json(), ev.lease) == ("put", key, {"name": "m"}, worker.instance_id)
        await worker.etcd.put(f"{ns}/mdc/m", {"card": 1})  # lease=False: persists
        await worker.close()  # graceful: the lease is revoked, its keys go at once
        ev = await asyncio.wait_for(watch.__anext__(), 5)
        assert (ev.kind, ev.key) == ("delete", key)
        assert (await frontend.etcd.get(f"{ns}/mdc/m")).json() == {"card": 1}
    finally:
        await watch.close()


async def test_slow_consumer_backpressures_the_handler(make_runtime, ns, serve):
    produced = [0]
    blob = "x" * 1000

    async def firehose(request):
        for i in range(request["n"]):
            produced[0] = i + 1
            yield {"i": i, "blob": blob}

    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), firehose)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    total = 30000
    stream = client.generate({"n": total})
    assert (await stream.__anext__())["i"] == 0
    # the consumer stalls: the caller asks the worker to hold the stream, and the handler is held there
    # (with unbounded buffering it would run to the end and nothing would ever be held)
    def held() -> bool:
        pool = worker.response_streams().mux_pool
        return pool is not None and any(sink.paused for conn in pool._conns.values() for sink in conn.sinks.values())

    await until(held, 10, "the worker to hold the stream")
    assert produced[0] < total
    count = 1
    async for item in stream:
        assert item["i"] == count
        count += 1
    assert count == total


async def test_losing_etcd_past_the_ttl_keeps_the_runtime_serving(nats_server, ns):
    """etcd gone for longer than the lease: the worker keeps serving the clients that know it (it used to
    shut down; docs/reliability.md)."""
    from harness.servers import EtcdServer

    with EtcdServer() as private_etcd:
        settings = RuntimeSettings(etcd=EtcdSettings([private_etcd.url]), nats=NatsSettings(nats_server.url),
                                   lease_ttl=1)
        worker = await DistributedRuntime.connect(settings)
        caller = await DistributedRuntime.connect(settings)
        try:
            endpoint = worker.namespace(ns).component("b").endpoint("g")
            ready = asyncio.Event()
            serving = asyncio.create_task(endpoint.serve_endpoint(echo, ready=ready))
            await asyncio.wait_for(ready.wait(), 10)
            client = await caller.namespace(ns).component("b").endpoint("g").client()
            await client.wait_for_instances(5)
            private_etcd.kill()
            await asyncio.sleep(2.5)  # the fault itself (not a wait for an event): etcd away past the 1 s lease
            assert not worker.is_shutting_down and not serving.done()
            assert len(await collect(client.generate({"n": 3}))) == 3
            await client.close()
        finally:
            await caller.close()
            await worker.close()


async def test_finished_streams_leave_no_bookkeeping(make_runtime, ns, serve):
    worker, caller = await make_runtime(), await make_runtime()
    await serve(worker.namespace(ns).component("b").endpoint("g"), echo)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    for _ in range(20):
        await collect(client.generate({"n": 1}))
    stream = client.generate({"n": 50})
    await stream.__anext__()
    await stream.aclose()
    await until(lambda: client._active == {} and caller.response_streams().started_receiver.pending == {}, 5, "the bookkeeping emptied")


@pytest.mark.parametrize("plane", ["nats", "tcp"])
async def test_the_trace_context_travels_in_the_request_messages_headers(make_runtime, plane):
    """The W3C context of the client's request-plane span reaches the worker in the message's headers, where
    1.x carries it, on either plane (a worker's span is then a child of the client's)."""
    from dynamo.runtime.transport import StreamState
    from dynamo.runtime.v1_wire import v1_path

    worker, caller = await make_runtime(request_plane=plane), await make_runtime(request_plane=plane)
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(request) -> None:
        got.set_result(dict(request.headers or {}))
        await request.respond(b"")

    served = await worker.request_plane().serve("trace_svc", "ep", handler,
                                                v1_path(worker.instance_id, "trace", "svc", "ep"))
    state = StreamState("r-1", worker.instance_id)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    state.trace = {"traceparent": parent}
    assert await caller.request_plane().send(served.address, b"{}", 5, state) == b""
    assert (await asyncio.wait_for(got, 5))["traceparent"] == parent
