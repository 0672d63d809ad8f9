"""Liveness and capacity between runtimes in this process (real etcd + NATS): heartbeats keep a slow
stream alive, an instance that never acknowledges is set aside, a worker at its limit refuses as busy.
Frozen worker processes (SIGSTOP) are in tests/chaos/test_stream_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.runtime import AckTimeoutError, NoRespondersError
from dynamo.runtime.ingress import Ingress
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.transport import ACK_PROBE
from harness.wait import until

LIVENESS = 0.4


async def _never_called(request):  # a probe (all these fakes get once they answer) runs no handler
    raise AssertionError(f"a probe reached the handler: {request!r}")
    yield


# the caller's response transport: multiplexed TCP (default), a TCP connection per stream, NATS subjects
TRANSPORTS = {"tcp": {}, "tcp-per-stream": {"tcp_mux": False}, "nats": {"response_transport": "nats"}}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_heartbeats_keep_a_slow_stream_alive(make_runtime, ns, serve, transport):
    """Silence three times the liveness bound between items (a long prefill) is slow, not frozen: the
    worker sends heartbeats as often as the caller's bound asks, on every response transport."""
    worker = await make_runtime()
    caller = await make_runtime(stream_liveness=LIVENESS, **TRANSPORTS[transport])

    async def slow(request):
        for i in range(2):
            await asyncio.sleep(LIVENESS * 3)
            yield {"i": i}

    await serve(worker.namespace(ns).component("b").endpoint("g"), slow)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    assert [x async for x in client.round_robin({})] == [{"i": 0}, {"i": 1}]
    assert client.instance_ids() == [worker.instance_id]


async def test_an_instance_that_never_acks_is_set_aside_until_it_answers(make_runtime, ns):
    caller = await make_runtime(stream_liveness=LIVENESS)
    fake = 0x5EED
    ep = EndpointId(ns, "b", "g")
    inst = Instance.for_endpoint(ep, fake)
    answering = asyncio.Event()
    thawed = Ingress(_never_called, name="thawed")  # what a worker that came back answers probes with

    async def frozen(msg):  # takes requests, acks nothing until "thawed"; then answers probes
        if answering.is_set():
            await thawed.on_request(msg)

    sub = await caller.nats.subscribe(inst.subject, cb=frozen)
    await caller.nats.flush()
    await caller.etcd.put(ep.instance_key(fake), inst.to_json())
    try:
        client = await caller.namespace(ns).component("b").endpoint("g").client()
        assert await client.wait_for_instances(5) == [fake]
        with pytest.raises(AckTimeoutError) as info:
            await client.round_robin({}).start()
        assert isinstance(info.value, NoRespondersError) and info.value.instance_id == fake
        assert client.instance_ids() == []  # set aside: no new request goes there
        answering.set()
        assert await client.wait_for_instances(5) == [fake]  # a probe got its answer
    finally:
        await caller.etcd.delete(ep.instance_key(fake))
        await sub.unsubscribe()


async def test_an_instance_whose_answers_never_reach_us_stays_aside_though_it_acks(make_runtime, ns):
    """Acks over NATS are half the way: an instance that acks everything but whose response streams never
    arrive (its host cut from ours while both reach NATS) is probed on the way back too, and stays aside
    probe after probe; once its answers get through it is sent requests again."""
    caller = await make_runtime(stream_liveness=LIVENESS)
    cut = 0x5EEF
    ep = EndpointId(ns, "b", "g")
    inst = Instance.for_endpoint(ep, cut)
    probes: list[bytes] = []
    healed = asyncio.Event()
    back = Ingress(_never_called, name="healed")

    async def acks_only(msg):
        if healed.is_set():
            await back.on_request(msg)
        else:
            probes.append(msg.data)
            await msg.respond(ACK_PROBE)  # acked as our worker acks a probe; the call-home never arrives

    sub = await caller.nats.subscribe(inst.subject, cb=acks_only)
    await caller.nats.flush()
    await caller.etcd.put(ep.instance_key(cut), inst.to_json())
    try:
        client = await caller.namespace(ns).component("b").endpoint("g").client()
        assert await client.wait_for_instances(5) == [cut]
        client.report_instance_unresponsive(cut, silent=True)  # as when one of its streams went silent
        await until(lambda: len(probes) >= 3, 10, "three probes")
        assert client.instance_ids() == [], "an ack alone put it back in rotation"
        assert all(p for p in probes), "a bare ping (an ack says nothing about the way back)"
        healed.set()
        assert await client.wait_for_instances(5) == [cut]  # a probe's empty stream came back
    finally:
        await caller.etcd.delete(ep.instance_key(cut))
        await sub.unsubscribe()


async def test_an_instance_with_no_responder_gets_requests_again_once_it_answers(make_runtime, ns):
    """A live worker that is not subscribed on NATS yet (it is still reconnecting after a NATS restart)
    gives "no responders" exactly like a dead one, and etcd, which would tell them apart, stays quiet.
    So the instance is pinged, and is sent requests again once it answers, with no etcd update at all."""
    caller = await make_runtime(stream_liveness=LIVENESS)
    late = 0x1A7E
    ep = EndpointId(ns, "b", "g")
    inst = Instance.for_endpoint(ep, late)
    await caller.etcd.put(ep.instance_key(late), inst.to_json())
    sub = None
    try:
        client = await caller.namespace(ns).component("b").endpoint("g").client()
        assert await client.wait_for_instances(5) == [late]
        with pytest.raises(NoRespondersError) as info:
            await client.round_robin({}).start()
        assert not isinstance(info.value, AckTimeoutError) and info.value.instance_id == late
        assert client.instance_ids() == []  # down: no new request goes there

        subscribed = Ingress(_never_called, name="late")  # subscribed at last: answers probes

        async def answer(msg):
            await subscribed.on_request(msg)

        sub = await caller.nats.subscribe(inst.subject, cb=answer)
        await caller.nats.flush()
        assert await client.wait_for_instances(5) == [late]  # a probe got its answer
    finally:
        await caller.etcd.delete(ep.instance_key(late))
        if sub is not None:
            await sub.unsubscribe()


async def test_a_worker_at_its_limit_refuses_as_busy_and_answers_pings(make_runtime, ns, at_its_limit):
    caller = await make_runtime()
    busy = await at_its_limit(await make_runtime(), caller, ns)
    assert busy.client.free_instance_ids() == []  # busy is not down, but skipped for a moment
    ack = await caller.nats.request(busy.endpoint.subject, b"", timeout=2)  # a ping is not a request
    assert ack.data == b""
    assert await busy.finish() == [{"done": True}]
