"""The disk tier of KV offloading (engines/kv_disk_tier.py): bounded LRU of checksummed files; anything
damaged reads as a miss (the engine then computes the prompt), and it leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynamo.engines.llamacpp.disk_tier import DiskKvTier
from dynamo.engines.llamacpp.host_tier import HostKvTier
from dynamo.kv.hashing import compute_hashes

BS = 4


def key(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_entries_round_trip_and_the_lru_keeps_it_bounded(tmp_path):
    d = DiskKvTier(tmp_path, max_bytes=3 * (72 + 100), block_size=BS)
    for i in range(3):
        assert d.put(key(8, 100 * i), bytes([i]) * 100)
    assert d.get(key(8, 0)) == b"\0" * 100  # now the most recently used
    assert d.put(key(8, 300), b"x" * 100)  # the oldest unused (100..) goes
    assert d.evicted == 1 and d.get(key(8, 100)) is None and d.get(key(8, 0)) is not None
    assert len(list(d.dir.glob("*.kv"))) == 3 and not list(d.dir.glob("*.tmp"))
    assert d.best([0, 1, 2, 3, 4, 99]) == (key(8, 0), 5)
    assert not d.put(key(4), b"y" * 1000)  # can never fit


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    d = DiskKvTier(tmp_path, max_bytes=1 << 20, block_size=BS)
    d.put(key(8), b"state" * 100)
    d.put(key(8, 50), b"other" * 100)
    path = d.path_of(key(8))
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-3] ^= 0xFF
        path.write_bytes(blob)
    elif damage == "truncate":
        path.write_bytes(blob[:-10])
    elif damage == "delete":
        path.unlink()
    else:  # a file written for other tokens under this name
        path.write_bytes(d.path_of(key(8, 50)).read_bytes())
    assert d.get(key(8)) is None
    assert d.corrupt == 1 and len(d) == 1 and not path.exists()
    assert d.get(key(8, 50)) == b"other" * 100


def test_blocks_are_announced_as_stored_and_removed(tmp_path):
    d = DiskKvTier(tmp_path, max_bytes=1 << 20, block_size=BS)
    d.put(key(10), b"a" * 10)
    local, seq = compute_hashes(list(key(10)), BS)
    assert d.names.take_events() == [{"stored": {"parent_hash": None, "blocks": [
        {"block_hash": seq[0], "tokens_hash": local[0]}, {"block_hash": seq[1], "tokens_hash": local[1]}]}}]
    d.put(key(12), b"b" * 10)  # covers the first entry: it goes, its blocks stay (the new entry holds them)
    assert len(d) == 1
    assert d.names.take_events() == [{"stored": {"parent_hash": seq[1], "blocks": [
        {"block_hash": compute_hashes(list(key(12)), BS)[1][2], "tokens_hash": compute_hashes(list(key(12)), BS)[0][2]}]}}]
    d.remove(key(12))
    assert d.names.take_events() == [{"removed": {"block_hashes": list(reversed(compute_hashes(list(key(12)), BS)[1]))}}]


def test_the_host_tier_spills_what_its_lru_evicts(tmp_path):
    d = DiskKvTier(tmp_path, max_bytes=1 << 20, block_size=BS)
    h = HostKvTier(max_bytes=250, block_size=BS, spill=d.put)
    for i in range(4):
        h.put(list(key(8, 100 * i)), bytes([i]) * 100)
    assert len(h) == 2 and len(d) == 2 and d.get(key(8, 0)) == b"\0" * 100
    removed = [e for e in h.names.take_events() if "removed" in e]
    assert len(removed) == 2  # host memory announces what left it; the disk announces what arrived
    assert sum(len(e["stored"]["blocks"]) for e in d.names.take_events()) == 4


def test_nothing_survives_close_or_a_killed_process(tmp_path):
    d = DiskKvTier(tmp_path, max_bytes=1 << 20)
    d.put(key(8), b"x")
    d.close()
    assert list(tmp_path.iterdir()) == []
    # a process that died without closing leaves its directory; the next tier removes it
    code = ("import sys; from dynamo.engines.llamacpp.disk_tier import DiskKvTier; "
            "d = DiskKvTier(sys.argv[1], 1 << 20); d.put((1, 2), b'x'); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    (left,) = tmp_path.iterdir()
    d2 = DiskKvTier(tmp_path, max_bytes=1 << 20)
    assert not left.exists() and list(tmp_path.iterdir()) == [d2.dir]
    d2.close()


def test_the_same_prefix_saved_again_keeps_its_blocks_announced(tmp_path):
    h = HostKvTier(max_bytes=1000, block_size=BS)
    h.put(list(key(8)), b"a" * 10)
    h.names.take_events()
    h.put(list(key(8)), b"b" * 10)
    assert h.names.take_events() == [] and h.get(key(8)) == b"b" * 10
    h.put(list(key(9)), b"c" * 10)  # covers it, and holds the same two blocks: nothing to say
    assert h.names.take_events() == [] and len(h) == 1


@pytest.mark.parametrize("args, message", [
    ({"host_cache_mb": 0, "disk_cache_mb": 64}, "needs host_cache_mb"),  # (the host tier is on unless 0)
    ({"host_cache_mb": 64, "disk_cache_dir": "/tmp/x"}, "disk_cache_mb is not"),
    ({"host_cache_mb": 64, "disk_cache_mb": -1}, "at least 0"),
    ({"host_cache_mb": "lots"}, "host_cache_mb must be a number"),
])
def test_disk_tier_arguments_that_cannot_work_are_errors(tmp_path, args, message):
    from dynamo.engines.llamacpp.engine import LlamaCppEngine
    from dynamo.errors import UserError

    with pytest.raises(UserError, match=message):
        LlamaCppEngine(tmp_path / "m.gguf", context_length=64, args=args)
