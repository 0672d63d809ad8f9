"""The fleet secret between runtimes in this process, on a file store of their own (no etcd, no NATS):
response streams come home over an authenticated connection, per stream and multiplexed; a stranger at
the client's call-home listener (another secret, none) is refused there and the streams carry on; a
client with another secret gets no answer; a subscriber with another secret reads no event."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest

from dynamo.runtime import DistributedRuntime, NoRespondersError
from dynamo.runtime.fleet_auth import HELLO_LEN, MAGIC, FleetAuth, FleetAuthError, dial
from dynamo.runtime.tcp import split_address
from dynamo.runtime.v1_event_wire import EndpointScope, Envelope
from harness.wait import until

SECRET = b"integration fleet secret, 32 ch"
OTHER = b"some other fleet's secret, 32 c"
SCOPE = EndpointScope("fs", "c", "g")


@pytest.fixture
def make(file_runtimes: Callable[..., Awaitable[DistributedRuntime]]) -> Callable[..., Awaitable[DistributedRuntime]]:
    return lambda secret, **overrides: file_runtimes(fleet_secret=secret, **overrides)


async def count(request: Any) -> AsyncIterator[dict[str, int]]:
    for i in range(request["n"]):
        yield {"i": i}


async def serving(rt: DistributedRuntime, name: str = "g") -> asyncio.Task:
    ready = asyncio.Event()
    task = asyncio.create_task(rt.namespace("fs").component("c").endpoint(name).serve_endpoint(count, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    return task


async def client_of(rt: DistributedRuntime, name: str = "g") -> Any:
    client = await rt.namespace("fs").component("c").endpoint(name).client()
    await client.wait_for_instances(10)
    return client


@pytest.mark.parametrize("mux", [True, False], ids=["multiplexed", "per-stream"])
async def test_streams_come_home_over_authenticated_connections(make, mux) -> None:
    worker = await make(SECRET, tcp_mux=mux)
    caller = await make(SECRET, tcp_mux=mux)
    task = await serving(worker)
    client = await client_of(caller)
    for n in (1, 5):
        assert [x["i"] async for x in client.generate({"n": n})] == list(range(n))
    assert (worker.response_streams().mux_pool is not None) == mux
    task.cancel()


@pytest.mark.parametrize("secret", [OTHER, None], ids=["another-secret", "no-secret"])
async def test_a_stranger_at_the_call_home_listener_is_refused_and_streams_carry_on(make, secret, caplog) -> None:
    caplog.set_level(logging.DEBUG)  # a repeat within the minute is logged at debug level
    worker = await make(SECRET)
    caller = await make(SECRET)
    task = await serving(worker)
    client = await client_of(caller)
    assert [x["i"] async for x in client.generate({"n": 2})] == [0, 1]  # the listener is open now
    receiver = caller.response_streams().started_receiver
    assert receiver is not None and receiver.address
    host, port = split_address(receiver.address)
    if secret is None:  # a worker without the secret would send its call-home frames from the first byte
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\x00" * 24)
        hello = await asyncio.wait_for(reader.read(), 5)  # the listener's hello, then it closes
        assert hello.startswith(MAGIC) and len(hello) == HELLO_LEN, hello
        writer.close()
    else:
        with pytest.raises(FleetAuthError, match="another DYN_FLEET_SECRET"):
            await dial(FleetAuth(secret), receiver.address, host, port, asyncio.Protocol, 5, "response streams")
    await until(lambda: "response streams: refused a connection from 127.0.0.1:" in caplog.text, 5,
                "the listener's line about the stranger")
    assert [x["i"] async for x in client.generate({"n": 3})] == [0, 1, 2]
    task.cancel()


async def test_a_client_with_another_secret_gets_no_answer(make) -> None:
    worker = await make(SECRET)
    stranger = await make(OTHER)
    task = await serving(worker)
    client = await client_of(stranger)
    with pytest.raises(NoRespondersError):
        async for _ in client.generate({"n": 2}):
            pass
    task.cancel()


async def test_a_subscriber_with_another_secret_reads_no_event(make) -> None:
    publisher = await make(SECRET)
    member = await make(SECRET)
    strangers = [await make(OTHER), await make(None)]
    got: dict[str, list[bytes]] = {"member": [], "other": [], "none": []}

    def into(name: str) -> Callable[[Envelope], None]:
        return lambda env: got[name].append(env.payload)

    await member.event_plane().subscribe(SCOPE, "kv-events", into("member"))
    await strangers[0].event_plane().subscribe(SCOPE, "kv-events", into("other"))
    await strangers[1].event_plane().subscribe(SCOPE, "kv-events", into("none"))
    pub = await publisher.event_plane().publisher(SCOPE, "kv-events")
    for i in range(200):  # until the member's connection is up: events before its handshake are lost
        pub.publish(b"%d" % i)  # (ZMQ: sent at once)
        if got["member"]:
            break
        await asyncio.sleep(0.05)
    assert got["member"] and got["other"] == [] and got["none"] == []


async def test_a_subscriber_that_knows_the_publishers_key_but_not_the_fleets_is_refused(make, caplog) -> None:
    """The publisher's public key is derived from the secret and never sent, but were it known: the
    publisher's ZAP handler still admits only the fleet's subscriber key, which the stranger cannot prove."""
    import zmq
    import zmq.asyncio

    from dynamo.runtime.zmq_curve import CurveKeys

    caplog.set_level(logging.DEBUG, logger="dynamo.runtime.fleet_auth")
    publisher = await make(SECRET)
    member = await make(SECRET)
    got: list[bytes] = []

    await member.event_plane().subscribe(SCOPE, "kv-events", lambda env: got.append(env.payload))
    pub = await publisher.event_plane().publisher(SCOPE, "kv-events")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        public, secret = zmq.curve_keypair()  # its own keypair, not the fleet's
        sub.curve_serverkey = CurveKeys(FleetAuth(SECRET)).server_public
        sub.curve_publickey, sub.curve_secretkey = public, secret
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.address)  # type: ignore[attr-defined]
        await until(lambda: "its key is not the fleet's" in caplog.text, 10, "the publisher's ZAP refusal")
        for i in range(200):  # until the member's connection is up
            pub.publish(b"%d" % i)  # (ZMQ: sent at once)
            if got:
                break
            await asyncio.sleep(0.05)
        assert got
        with pytest.raises(zmq.Again):
            await sub.recv_multipart(flags=zmq.NOBLOCK)
    finally:
        sub.close(linger=0)
        ctx.term()
