"""The file discovery store on a real directory: keys, create-if-absent, leases and their expiry, watches
(in this process, from another process, and by polling), leftovers of a crashed process, the object store."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from dynamo.runtime.discovery import Discovery, WatchEvent
from dynamo.runtime.file_kv import FileStoreError, key_file_name
from dynamo.runtime.file_object_store import FileObjectStore
from dynamo.runtime.file_store import FileStore
from dynamo.runtime.file_v1 import STALE_AFTER
from dynamo.runtime.lease import LeaseKeeper
from dynamo.runtime.object_store import ObjectStore, ObjectStoreError


@pytest.fixture
async def store(tmp_path: Path):
    s = FileStore(tmp_path / "kv", tick=0.1)
    await s.connect()
    yield s
    await s.close()


async def next_event(watch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_is_a_discovery_store(store: FileStore) -> None:
    assert isinstance(store, Discovery)
    assert isinstance(FileObjectStore(store.root, "b"), ObjectStore)


async def test_put_get_prefix_delete_with_revisions(store: FileStore) -> None:
    r1 = await store.put("a/1", b"one")
    r2 = await store.put("a/1", b"uno")
    await store.put("a/2", b"two")
    await store.put("b/1", b"other")
    kv = await store.get("a/1")
    assert kv is not None and kv.value == b"uno" and r2 > r1
    assert (kv.create_revision, kv.mod_revision, kv.version) == (r1, r2, 2)
    assert [k.key for k in await store.get_prefix("a/")] == ["a/1", "a/2"]
    assert await store.delete("a/1") == 1
    assert await store.delete("a/1") == 0
    assert await store.get("a/1") is None
    assert await store.delete_prefix("a/") == 1
    assert [k.key for k in await store.get_prefix("")] == ["b/1"]


async def test_keys_any_text_even_too_long_for_a_file_name(store: FileStore) -> None:
    odd = "instances/ns/Back End/gen:ab/..\\x%2F" + "é" * 5
    long = "models/" + "x" * 400
    await store.put(odd, b"1")
    await store.put(long, b"2")
    assert (await store.get(odd)).value == b"1"  # type: ignore[union-attr]
    assert (await store.get(long)).value == b"2"  # type: ignore[union-attr]
    assert key_file_name(long).startswith("h_") and len(key_file_name(long)) < 255


async def test_create_if_absent_is_atomic_across_processes(store: FileStore) -> None:
    """Eight processes race to create one key: exactly one wins."""
    code = ("import asyncio,sys\nfrom dynamo.runtime.file_store import FileStore\n"
            "async def m():\n s=FileStore(sys.argv[1]); await s.connect()\n"
            " print(await s.create('race/key', sys.argv[2].encode()))\nasyncio.run(m())")
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", code, str(store.root), str(i),
                                                  stdout=asyncio.subprocess.PIPE) for i in range(8)]
    outs = [(await asyncio.wait_for(p.communicate(), 60))[0].decode().strip() for p in procs]
    assert sorted(outs) == ["False"] * 7 + ["True"], outs
    winner = outs.index("True")
    assert (await store.get("race/key")).value == str(winner).encode()  # type: ignore[union-attr]


async def test_put_if_changed(store: FileStore) -> None:
    lease = await store.grant_lease(10)
    assert await store.put_if_changed("k", b"v", lease) is True
    assert await store.put_if_changed("k", b"v", lease) is False
    assert await store.put_if_changed("k", b"w", lease) is True


async def test_lease_keys_go_on_revoke_and_the_id_can_be_granted_again(store: FileStore) -> None:
    lease = await store.grant_lease(10)
    await store.put("svc/a", b"1", lease)
    assert (await store.keep_alive(lease))[0] == 10
    with pytest.raises(FileStoreError):
        await store.grant_lease(10, lease)  # in use
    await store.revoke_lease(lease)
    assert await store.get("svc/a") is None
    assert (await store.keep_alive(lease))[0] == 0
    assert await store.grant_lease(10, lease) == lease  # the same id again (an instance keeps its identity)
    with pytest.raises(FileStoreError):
        await store.put("svc/b", b"1", 12345)  # a lease nobody granted


async def test_expired_lease_hides_its_keys_and_keep_alive_says_so(store: FileStore) -> None:
    lease = await store.grant_lease(1)
    await store.put("svc/a", b"1", lease)
    await store.put("svc/permanent", b"1")
    await asyncio.sleep(1.2)
    assert await store.get("svc/a") is None  # gone to every reader once expired, cleaned or not
    assert [k.key for k in await store.get_prefix("svc/")] == ["svc/permanent"]
    assert (await store.keep_alive(lease))[0] == 0
    assert not any(p.name.startswith("k_svc%2Fa") for p in (store.root / "kv").iterdir())  # and cleaned up


async def test_lease_keeper_keeps_a_file_lease_alive_and_regrants_it(store: FileStore) -> None:
    keeper = LeaseKeeper(store, 1)
    lease = await keeper.start()
    try:
        await store.put("svc/kept", b"1", lease)
        await asyncio.sleep(2.0)  # twice the TTL: refreshed every TTL/3
        assert await store.get("svc/kept") is not None
        await store.revoke_lease(lease)  # as if it had expired while the process was stopped
        for _ in range(50):
            if keeper.regrants:
                break
            await asyncio.sleep(0.1)
        assert keeper.regrants == 1 and keeper.lease_id == lease
    finally:
        await keeper.revoke()
    assert await store.get("svc/kept") is None


async def test_watch_lists_then_follows_puts_deletes_and_expiry(store: FileStore) -> None:
    await store.put("m/old", b"0")
    watch = await store.watch_prefix("m/").start()
    try:
        assert [kv.key for kv in watch.initial] == ["m/old"]
        ev = await next_event(watch)
        assert (ev.kind, ev.key, ev.initial) == ("put", "m/old", True)
        lease = await store.grant_lease(1)
        started = time.monotonic()
        await store.put("m/new", b"1", lease)
        ev = await next_event(watch)
        assert (ev.kind, ev.key, ev.value, ev.lease, ev.initial) == ("put", "m/new", b"1", lease, False)
        assert time.monotonic() - started < 1.0  # a file event, not a tick or a lease check
        await store.put("other/x", b"ignored")
        await store.delete("m/old")
        ev = await next_event(watch)
        assert (ev.kind, ev.key) == ("delete", "m/old")
        ev = await next_event(watch)  # nobody refreshes the lease: its key is deleted for the watcher
        assert (ev.kind, ev.key) == ("delete", "m/new")
    finally:
        await watch.close()
    with pytest.raises(StopAsyncIteration):
        await watch.__anext__()


async def test_polling_fallback_sees_changes(tmp_path: Path) -> None:
    store = FileStore(tmp_path, poll_interval=0.1)
    await store.connect()
    try:
        watch = await store.watch_prefix("p/").start()
        await store.put("p/1", b"1")
        ev = await next_event(watch, 3)
        assert (ev.kind, ev.key) == ("put", "p/1")
        assert store.watcher.mode == "poll"
        await store.delete("p/1")
        assert (await next_event(watch, 3)).kind == "delete"
    finally:
        await store.close()


WRITER = """
import asyncio, os, sys
from dynamo.runtime.file_store import FileStore
from dynamo.runtime.lease import LeaseKeeper
async def main():
    store = FileStore(sys.argv[1]); await store.connect()
    keeper = LeaseKeeper(store, int(sys.argv[2])); lease = await keeper.start()
    await store.put("workers/" + str(os.getpid()), b"alive", lease)
    print(lease, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_a_process_killed_9_disappears_from_another_process_watch_within_the_ttl(store: FileStore) -> None:
    watch = await store.watch_prefix("workers/").start()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(store.root), "2",
                                                stdout=asyncio.subprocess.PIPE)
    try:
        await asyncio.wait_for(proc.stdout.readline(), 30)  # type: ignore[union-attr]
        ev = await next_event(watch)
        assert (ev.kind, ev.key) == ("put", f"workers/{proc.pid}")
        await asyncio.sleep(2.5)  # longer than the TTL: the keeper in the child refreshes it
        assert await store.get(f"workers/{proc.pid}") is not None
        proc.kill()
        killed = time.monotonic()
        ev = await next_event(watch, 10)
        assert (ev.kind, ev.key) == ("delete", f"workers/{proc.pid}")
        assert time.monotonic() - killed < 2 + 1.0  # the TTL, plus the watcher's tick
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await watch.close()


V1_WRITER = WRITER.replace('"workers/" + str(os.getpid())', '"v1/instances/ns/c/e/" + format(os.getpid(), "x")')


async def test_a_killed_process_v1_records_go_with_its_lease_not_after_1x_staleness(store: FileStore) -> None:
    """Every record of ours is a 1.x ``v1/`` file, which 1.x keeps until untouched for STALE_AFTER (10 s);
    ours go when their lease expires, removed by whoever finds it expired (here: this store's tick)."""
    watch = await store.watch_prefix("v1/instances/").start()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", V1_WRITER, str(store.root), "2",
                                                stdout=asyncio.subprocess.PIPE)
    key = ""
    try:
        await asyncio.wait_for(proc.stdout.readline(), 30)  # type: ignore[union-attr]
        key = f"v1/instances/ns/c/e/{proc.pid:x}"
        ev = await next_event(watch)
        assert (ev.kind, ev.key) == ("put", key)
        lease_files = list((store.root / "leases").iterdir())
        assert [json.loads(f.read_text()).get("v1") for f in lease_files] == [[f"instances/{key.split('/', 2)[2].replace('/', '%2F')}"]]
        proc.kill()
        # a 2 s lease: the delete comes long before the file could go stale (10 s untouched)
        ev = await next_event(watch, STALE_AFTER - 3)
        assert (ev.kind, ev.key) == ("delete", key)
        assert not store.kv.v1.path(key).exists()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await watch.close()


async def test_an_expired_lease_record_cannot_point_outside_the_v1_buckets(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    bystander = tmp_path / "precious"
    bystander.write_text("keep me")
    first = FileStore(root)
    await first.connect()
    lease = await first.grant_lease(10)
    await first.close()
    lease_file = root / "leases" / format(lease, "x")
    record = json.loads(lease_file.read_text())
    record["expires"] = time.time() - 60
    record["v1"] = ["../../precious", "/etc/passwd", "instances/../../../precious", "instances"]
    lease_file.write_text(json.dumps(record))
    second = FileStore(root)
    await second.connect()
    try:
        assert not lease_file.exists()  # the lease was cleaned up
        assert bystander.read_text() == "keep me"
    finally:
        await second.close()


async def test_leftovers_of_a_crashed_process_are_removed_when_a_store_opens(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    first = FileStore(root)
    await first.connect()
    lease = await first.grant_lease(10)
    await first.put("instances/ns/c/e:dead", b"{}", lease)
    await first.close()
    # the process crashed long ago: its lease file says it expired
    lease_file = root / "leases" / format(lease, "x")
    record = json.loads(lease_file.read_text())
    record["expires"] = time.time() - 60
    lease_file.write_text(json.dumps(record))
    second = FileStore(root)
    await second.connect()
    try:
        assert await second.get_prefix("instances/") == []
        assert not lease_file.exists()
        assert [p for p in (root / "kv").iterdir() if not p.name.startswith(".")] == []
    finally:
        await second.close()


async def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(FileStoreError, match="cannot use .*file"):
        await FileStore(blocker / "kv").connect()


async def test_object_store_put_if_absent_and_get(tmp_path: Path) -> None:
    a, b = FileObjectStore(tmp_path, "mdc"), FileObjectStore(tmp_path, "mdc")
    assert await a.put_if_absent("sha256:abc", b"tokenizer") is True
    assert await b.put_if_absent("sha256:abc", b"other") is False
    assert await b.get("sha256:abc") == b"tokenizer"
    with pytest.raises(ObjectStoreError, match="no object"):
        await a.get("missing")
