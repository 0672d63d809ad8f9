"""The file store's ``v1/`` keys in Dynamo 1.x's own format, on a real directory: a folder written by hand
as 1.6.1 writes it (bucket directories, percent-encoded names, raw JSON, liveness by mtime) is read, listed
and watched through the Discovery protocol; our writes come out in that format, stay alive by touching,
and go with their lease; an endpoint's instances, 1.x's and ours, are one record each in one bucket."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dynamo.runtime.file_store import FileStore
from dynamo.runtime.file_v1 import STALE_AFTER
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.v1_records import instances_prefix

ID = 6482263448558532528
NAME = "d16%2Fbackend%2Fgenerate%2F59f5a0430fd477b0"
KEY = "v1/instances/d16/backend/generate/59f5a0430fd477b0"


def endpoint_record(instance_id: int, hostport: str, **kw) -> bytes:
    """A 1.6.1 worker's Endpoint record (what instance.py writes for a 1.x-shaped Instance, byte for byte)."""
    return Instance("d16", "backend", "generate", instance_id, f"{hostport}/{instance_id:x}/d16/backend/generate",
                    ours=False, **kw).to_json()


@pytest.fixture
async def store(tmp_path: Path):
    s = FileStore(tmp_path / "kv", tick=0.1)
    await s.connect()
    yield s
    await s.close()


def write_as_1_6_1(root: Path, bucket: str, name: str, value: bytes, *, age: float = 0.0) -> Path:
    """What a 1.6.1 process leaves: ``<root>/v1/<bucket>/<name>`` holding the raw value."""
    folder = root / "v1" / bucket
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = folder / ".tmp_0123456789abcdef"
    tmp.write_bytes(value)
    os.replace(tmp, path)
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


async def next_event(watch, timeout: float = 5.0):
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_a_1_6_1_folder_is_read_through_the_protocol(store: FileStore) -> None:
    record = endpoint_record(ID, "127.0.0.1:43837", device_type="cuda")
    write_as_1_6_1(store.root, "instances", NAME, record)
    write_as_1_6_1(store.root, "mdc", NAME, b'{"type":"Model"}')
    stale = write_as_1_6_1(store.root, "instances", "d16%2Fbackend%2Fgenerate%2F1", record, age=STALE_AFTER + 5)
    await store.put("instances/ours:1", b"x")
    kv = await store.get(KEY)
    assert kv is not None and kv.value == record and kv.lease == 0
    assert [k.key for k in await store.get_prefix("v1/instances/")] == [KEY]
    assert [k.key for k in await store.get_prefix("v1/")] == ["v1/instances/d16/backend/generate/59f5a0430fd477b0",
                                                              "v1/mdc/d16/backend/generate/59f5a0430fd477b0"]
    assert [k.key for k in await store.get_prefix("")][0] == "instances/ours:1"
    assert await store.get("v1/instances/d16/backend/generate/1") is None  # stale: gone
    assert await asyncio.to_thread(store.kv.clean_up) >= 1 and not stale.exists()  # and reaped, as 1.x does


async def test_our_v1_writes_are_1_x_files_kept_alive_and_gone_with_the_lease(store: FileStore) -> None:
    lease = await store.grant_lease(10)
    await store.put(KEY, b'{"v":1}', lease)
    path = store.root / "v1" / "instances" / NAME
    assert path.read_bytes() == b'{"v":1}'
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp_")]
    assert (await store.get(KEY)).lease == lease  # type: ignore[union-attr]
    assert not await store.create(KEY, b"other", lease)
    assert await store.put_if_changed(KEY, b'{"v":1}', lease) is False
    old = time.time() - 8
    os.utime(path, (old, old))
    await asyncio.to_thread(store.kv.touch_v1)
    assert path.stat().st_mtime > time.time() - 2
    path.unlink()  # reaped while we were stopped: written again while the lease lives
    await asyncio.to_thread(store.kv.touch_v1)
    assert path.read_bytes() == b'{"v":1}'
    await store.revoke_lease(lease)
    assert not path.exists() and await store.get(KEY) is None
    with pytest.raises(Exception, match="not found"):
        await store.put(KEY, b"x", lease)


async def test_create_replaces_a_stale_file(store: FileStore) -> None:
    write_as_1_6_1(store.root, "instances", NAME, b"dead", age=STALE_AFTER + 1)
    assert await store.create(KEY, b"alive")
    assert (await store.get(KEY)).value == b"alive"  # type: ignore[union-attr]
    assert await store.delete(KEY) == 1 and await store.delete(KEY) == 0


async def test_watches_see_1_x_files_come_and_go(store: FileStore) -> None:
    watch = store.watch_prefix("v1/instances/d16/")
    await watch.start()
    path = write_as_1_6_1(store.root, "instances", NAME, b"{}")
    ev = await next_event(watch)
    assert (ev.kind, ev.key, ev.value) == ("put", KEY, b"{}")
    path.unlink()
    ev = await next_event(watch)
    assert (ev.kind, ev.key) == ("delete", KEY)
    await watch.close()


async def test_a_1_x_worker_and_ours_are_one_record_each(store: FileStore) -> None:
    """What a client follows: the endpoint's v1/instances records, a 1.x worker's as 1.6.1 wrote it and ours
    as we write it (one per instance, ours saying so), gone with the file or the lease."""
    ep = EndpointId("d16", "backend", "generate")
    write_as_1_6_1(store.root, "instances", NAME, endpoint_record(ID, "127.0.0.1:43837"))
    watch = await store.watch_prefix(instances_prefix(ep)).start()
    assert [Instance.from_json(kv.value) for kv in watch.initial] == [
        Instance("d16", "backend", "generate", ID, "127.0.0.1:43837/59f5a0430fd477b0/d16/backend/generate", ours=False)]
    assert (await next_event(watch)).initial
    lease = await store.grant_lease(10)
    ours = Instance.for_endpoint(ep, lease, f"127.0.0.1:5000/{lease:x}/d16/backend/generate")
    assert await store.create(ep.instance_key(lease), ours.to_json(), lease)
    assert not await store.create(ep.instance_key(lease), ours.to_json(), lease)  # one record per instance
    ev = await next_event(watch)
    assert (ev.kind, ev.key) == ("put", f"v1/instances/d16/backend/generate/{lease:x}")
    assert Instance.from_json(ev.value) == ours and ours.ours
    assert len(list((store.root / "v1" / "instances").iterdir())) == 2  # 1.x's files: nothing else of ours
    (store.root / "v1" / "instances" / NAME).unlink()  # the 1.x worker goes
    ev = await next_event(watch)
    assert (ev.kind, ev.key) == ("delete", KEY)
    await store.revoke_lease(lease)  # ours goes with its lease
    ev = await next_event(watch)
    assert (ev.kind, ev.key) == ("delete", ep.instance_key(lease))
    await watch.close()

