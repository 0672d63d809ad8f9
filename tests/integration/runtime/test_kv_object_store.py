"""The object store of a fleet on etcd without NATS: a model card's files chunked into etcd, read back by
another process's runtime (what a frontend on another machine does), checked, and damage reported."""

from __future__ import annotations

import os

import pytest

from dynamo.runtime.config import NatsSettings
from dynamo.runtime.kv_object_store import CHUNK, DiscoveryObjectStore
from dynamo.runtime.object_store import ObjectStoreError
from harness.servers import free_port


@pytest.fixture
def no_nats():
    return NatsSettings(f"nats://127.0.0.1:{free_port()}", explicit=False)


async def test_an_object_bigger_than_etcd_takes_goes_in_chunks_and_comes_back(make_runtime, no_nats, ns):
    worker = await make_runtime(nats=no_nats)
    frontend = await make_runtime(nats=no_nats)
    assert worker.nats is None
    data = os.urandom(3 * CHUNK + 1234)  # over etcd's 1.5 MiB request limit in one piece
    assert await worker.object_store(ns).put_if_absent("tok-abc", data)
    assert not await worker.object_store(ns).put_if_absent("tok-abc", b"other")  # names are content hashes
    assert await frontend.object_store(ns).get("tok-abc") == data
    with pytest.raises(ObjectStoreError, match="no object 'nothing'"):
        await frontend.object_store(ns).get("nothing")
    assert isinstance(frontend.object_store(ns), DiscoveryObjectStore)
    # a chunk lost or changed is an error, not a wrong tokenizer
    await worker.discovery().put(f"objects/{ns}/tok-abc/000001", b"x")
    with pytest.raises(ObjectStoreError, match="incomplete or damaged"):
        await frontend.object_store(ns).get("tok-abc")


async def test_with_nats_a_card_left_in_etcd_is_still_read(make_runtime, no_nats, ns):
    """A worker without NATS stores in etcd; a frontend with NATS finds it there."""
    worker = await make_runtime(nats=no_nats)
    frontend = await make_runtime()
    assert frontend.nats is not None
    await worker.object_store(ns).put_if_absent("card", b"tokenizer bytes")
    assert await frontend.object_store(ns).get("card") == b"tokenizer bytes"
