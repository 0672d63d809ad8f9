"""The etcd gateway client against a real etcd 3.5: KV, create-if-absent, leases, get-then-watch."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamo.runtime import EtcdClient, RuntimeConnectionError
from dynamo.runtime.config import EtcdSettings


@pytest.fixture
async def etcd(etcd_server):
    client = EtcdClient(EtcdSettings([etcd_server.url]))
    await client.connect()
    yield client
    await client.close()


async def test_kv_roundtrip(etcd, ns):
    rev = await etcd.put(f"{ns}/a", {"x": 1})
    assert rev > 0
    kv = await etcd.get(f"{ns}/a")
    assert kv is not None and kv.json() == {"x": 1} and kv.version == 1
    assert await etcd.get(f"{ns}/missing") is None
    await etcd.put(f"{ns}/b", "text")
    await etcd.put(f"{ns}x/other", b"not under the prefix")
    assert [kv.key for kv in await etcd.get_prefix(f"{ns}/")] == [f"{ns}/a", f"{ns}/b"]
    assert await etcd.delete(f"{ns}/a") == 1
    assert await etcd.delete(f"{ns}/a") == 0
    assert await etcd.delete_prefix(f"{ns}/") == 1


async def test_create_if_absent(etcd, ns):
    assert await etcd.create(f"{ns}/k", b"first") is True
    assert await etcd.create(f"{ns}/k", b"second") is False
    assert (await etcd.get(f"{ns}/k")).value == b"first"


async def test_lease_keys_vanish_on_revoke(etcd, ns):
    lease = await etcd.grant_lease(10)
    await etcd.put(f"{ns}/leased", b"v", lease)
    assert (await etcd.get(f"{ns}/leased")).lease == lease
    assert await etcd.keep_alive_once(lease) == 10
    await etcd.revoke_lease(lease)
    assert await etcd.get(f"{ns}/leased") is None
    assert await etcd.keep_alive_once(lease) == 0
    await etcd.revoke_lease(lease)  # unknown lease: not an error


async def test_watch_sees_existing_then_changes(etcd, ns):
    await etcd.put(f"{ns}/w/1", b"one")
    watch = await etcd.watch_prefix(f"{ns}/w")
    try:
        assert [kv.key for kv in watch.initial] == [f"{ns}/w/1"]
        await etcd.put(f"{ns}/w/2", b"two")
        await etcd.delete(f"{ns}/w/1")
        events = [await asyncio.wait_for(watch.__anext__(), 5) for _ in range(3)]
        assert [(e.kind, e.key, e.initial) for e in events] == [
            ("put", f"{ns}/w/1", True),
            ("put", f"{ns}/w/2", False),
            ("delete", f"{ns}/w/1", False),
        ]
        assert events[1].value == b"two"
    finally:
        await watch.close()


async def test_watch_has_no_gap_between_listing_and_watch(etcd, ns):
    """Keys written right after the listing, before the stream opens, still arrive."""
    watch = etcd.watch_prefix(f"{ns}/g")
    await watch.start()
    for i in range(20):
        await etcd.put(f"{ns}/g/{i}", b"x")
    keys = [(await asyncio.wait_for(watch.__anext__(), 5)).key for _ in range(20)]
    await watch.close()
    assert keys == [f"{ns}/g/{i}" for i in range(20)]


async def test_unreachable_etcd_fails_fast():
    client = EtcdClient(EtcdSettings(["http://127.0.0.1:1"]))
    start = time.monotonic()
    with pytest.raises(RuntimeConnectionError) as err:
        await client.connect()
    assert time.monotonic() - start < 5
    assert str(err.value) == "cannot reach etcd at http://127.0.0.1:1: connection refused"


async def test_many_watches_do_not_starve_requests(etcd, ns):
    """Each watch holds a streaming HTTP connection; plain requests must still go through."""
    watches = [await etcd.watch_prefix(f"{ns}/many/{i}") for i in range(80)]
    try:
        await asyncio.wait_for(etcd.put(f"{ns}/many/3/x", b"v"), 5)
        ev = await asyncio.wait_for(watches[3].__anext__(), 5)
        assert ev.key == f"{ns}/many/3/x"
    finally:
        for w in watches:
            await w.close()
