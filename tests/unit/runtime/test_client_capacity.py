"""The client's view of worker capacity and health without servers: limits per instance, the wait queue
for a worker with room, and instances set aside as unresponsive. The request plane behind it is a stub; the
same paths run against real workers in tests/chaos/test_stream_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.runtime import RuntimeSettings
from dynamo.runtime.client import Client
from dynamo.runtime.errors import RuntimeConfigError
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.transport import StreamState

EP = EndpointId("ns", "comp", "gen")


class _Requests:
    """A request plane for probes: ``answers`` says whether a ping is acknowledged."""

    def __init__(self) -> None:
        self.answers = False
        self.pings = 0
        self.pinged = asyncio.Condition()

    async def send(self, address: str, payload: bytes, timeout: float, state=None) -> bytes:
        async with self.pinged:
            self.pings += 1
            self.pinged.notify_all()
        if not self.answers:
            raise TimeoutError
        return b""

    async def until_pinged(self, n: int) -> None:
        async with asyncio.timeout(2), self.pinged:
            await self.pinged.wait_for(lambda: self.pings >= n)


def make_client(*ids: int, liveness: float = 0.2) -> Client:
    client = Client(EP, settings=RuntimeSettings(stream_liveness=liveness), requests=_Requests())  # type: ignore[arg-type]
    for i in ids:
        client._instances[i] = Instance.for_endpoint(EP, i)
    client._recompute()
    return client


def occupy(client: Client, instance_id: int) -> StreamState:
    state = StreamState("r", instance_id)
    client._track(state)
    return state


async def test_full_instances_are_skipped_and_freed_slots_reused():
    client = make_client(1, 2)
    client.set_instance_limit(1, 1)
    client.set_instance_limit(2, 2)
    assert client.free_instance_ids() == [1, 2]
    occupy(client, 1)
    assert client.free_instance_ids() == [2]
    assert {client._select("round_robin", None)[0] for _ in range(4)} == {2}
    busy = [occupy(client, 2), occupy(client, 2)]
    assert client.free_instance_ids() == []
    client._untrack(busy[0])
    assert client.free_instance_ids() == [2]


async def test_capacity_queue_is_first_come_first_served_and_bounded():
    client = make_client(1)
    client.set_instance_limit(1, 1)
    held = occupy(client, 1)
    loop = asyncio.get_running_loop()
    order: list[str] = []

    async def wait(name: str) -> bool:
        ok = await client.wait_for_capacity(loop.time() + 5, max_waiters=2)
        if ok:
            order.append(name)
            occupy(client, 1)  # take the slot at once, as a request does
        return ok

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert client.queued() == 2
    assert await client.wait_for_capacity(loop.time() + 5, max_waiters=2) is False  # the queue is full
    client._untrack(held)
    assert await first is True and order == ["first"]
    assert not second.done()
    client._untrack(next(iter(client._active[1])))
    assert await second is True and order == ["first", "second"]


async def test_capacity_wait_ends_at_the_deadline():
    client = make_client(1)
    client.set_instance_limit(1, 1)
    occupy(client, 1)
    loop = asyncio.get_running_loop()
    assert await client.wait_for_capacity(loop.time() + 0.05, max_waiters=8) is False
    assert client.queued() == 0


async def test_a_woken_waiter_that_goes_away_passes_the_slot_on():
    client = make_client(1)
    client.set_instance_limit(1, 1)
    held = occupy(client, 1)
    loop = asyncio.get_running_loop()
    gone = asyncio.create_task(client.wait_for_capacity(loop.time() + 5, max_waiters=8))
    await asyncio.sleep(0)
    stays = asyncio.create_task(client.wait_for_capacity(loop.time() + 5, max_waiters=8))
    await asyncio.sleep(0)
    client._untrack(held)  # wakes `gone` ...
    gone.cancel()  # ... which is cancelled before it runs (its HTTP client disconnected)
    assert await asyncio.wait_for(stays, 1) is True


async def test_no_limits_means_no_waiting():
    client = make_client(1, 2)
    for _ in range(10):
        occupy(client, 1)
    assert await client.wait_for_capacity(asyncio.get_running_loop().time(), max_waiters=0) is True


async def test_an_unresponsive_instance_is_set_aside_until_it_answers_a_probe():
    client = make_client(1, 2, liveness=0.2)
    plane = client.requests
    assert isinstance(plane, _Requests)
    client.report_instance_unresponsive(1)
    assert client.instance_ids() == [2]
    assert {client._select("round_robin", None)[0] for _ in range(4)} == {2}
    await plane.until_pinged(2)  # probed, still frozen: stays aside
    assert client.instance_ids() == [2]
    plane.answers = True
    await asyncio.wait_for(client._changed.wait(), 2)
    assert client.instance_ids() == [1, 2]
    await client.close()


async def test_an_instance_with_no_responder_is_down_until_it_answers_a_probe():
    """No etcd update comes for a live worker that is merely not subscribed yet: the probe brings it back."""
    client = make_client(1, 2, liveness=0.2)
    nats = client.requests
    assert isinstance(nats, _Requests)
    client.report_instance_down(1)
    assert client.instance_ids() == [2]
    await nats.until_pinged(2)  # probed, still no answer: stays down
    assert client.instance_ids() == [2]
    nats.answers = True
    await asyncio.wait_for(client._changed.wait(), 2)
    assert client.instance_ids() == [1, 2]
    assert not client._probes
    await client.close()


def test_liveness_bound_from_env(monkeypatch):
    monkeypatch.setenv("DYN_STREAM_LIVENESS_S", "1.5")
    assert RuntimeSettings.from_env().stream_liveness == 1.5
    monkeypatch.delenv("DYN_STREAM_LIVENESS_S")
    assert RuntimeSettings.from_env().stream_liveness == 5.0
    for bad in ("soon", "0"):
        monkeypatch.setenv("DYN_STREAM_LIVENESS_S", bad)
        with pytest.raises(RuntimeConfigError, match="DYN_STREAM_LIVENESS_S"):
            RuntimeSettings.from_env()
