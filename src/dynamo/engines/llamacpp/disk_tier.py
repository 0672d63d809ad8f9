"""A disk tier behind the host-memory tier (KV offloading): what the host tier's LRU pushes out is written
here, bounded in bytes, least recently used out; a later request with that prefix reads it back.

Files are written atomically (a temporary name in the same directory, then ``os.replace``), so a reader
never sees half a file.  Each starts with a magic, the sha256 of the entry's tokens and the sha256 of the
state; a file that is missing, short, or fails either check is deleted and reported as a miss, and the
engine computes the prompt instead (a damaged cache costs time, never a wrong answer).

The tier lives in a directory of its own under ``disk_cache_dir`` (``kv-<pid>-<random>``), removed on
close: a state is only meaningful to the process (model, context parameters) that wrote it, and the router
is told ``cleared`` when a worker starts, so nothing here is meant to survive a restart.  Directories of
processes that no longer exist are removed at start.  Writes happen in the engine's scheduler thread,
never on the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import struct
from collections import OrderedDict
from pathlib import Path

from dynamo.engines.llamacpp.host_tier import TierBlocks, best_entry

log = logging.getLogger(__name__)

MAGIC = b"DYNKVST1"
_HEADER = len(MAGIC) + 32 + 32
_DIR = re.compile(r"kv-(\d+)-[0-9a-f]+$")


def _key_digest(key: tuple[int, ...]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(key)}I", *key)).digest()


class DiskKvTier:
    def __init__(self, root: Path | str, max_bytes: int, block_size: int = 16) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        _remove_dead_dirs(self.root)
        self.dir = self.root / f"kv-{os.getpid()}-{secrets.token_hex(4)}"
        self.dir.mkdir()
        self._items: OrderedDict[tuple[int, ...], tuple[Path, int]] = OrderedDict()
        self._seq = 0
        self.bytes = 0
        self.saved = 0
        self.restored = 0
        self.evicted = 0
        self.corrupt = 0
        self.names = TierBlocks(block_size)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[tuple[int, ...]]:
        return list(self._items)

    def put(self, key: tuple[int, ...], data: bytes) -> bool:
        """Write the state of ``key``; False if it can never fit or the write failed (logged)."""
        size = _HEADER + len(data)
        if size > self.max_bytes:
            return False
        covered = [k for k in self._items if len(k) <= len(key) and key[:len(k)] == k]
        for k in covered:  # their names go once the new entry (which holds their blocks) is named
            path, old_size = self._items.pop(k)
            self.bytes -= old_size
            path.unlink(missing_ok=True)
        while self.bytes + size > self.max_bytes and self._items:
            self.remove(next(iter(self._items)))
            self.evicted += 1
        self._seq += 1
        path = self.dir / f"{self._seq:08d}.kv"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(_key_digest(key))
                f.write(hashlib.sha256(data).digest())
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("KV disk tier: writing %s failed: %s", path, e)
            tmp.unlink(missing_ok=True)
            for k in covered:
                self.names.drop(k)
            return False
        self._items[key] = (path, size)
        self.bytes += size
        self.names.add(key)
        for k in covered:
            if k != key:  # the same tokens again keep their names
                self.names.drop(k)
        self.saved += 1
        return True

    def best(self, prompt: list[int]) -> tuple[tuple[int, ...], int] | None:
        return best_entry(self._items, prompt)

    def get(self, key: tuple[int, ...]) -> bytes | None:
        """The state of ``key``, checked; None (and the entry gone) if the file is missing or damaged."""
        item = self._items.get(key)
        if item is None:
            return None
        path, size = item
        try:
            blob = path.read_bytes()
        except OSError as e:
            blob = b""
            why = str(e)
        else:
            why = self._check(blob, key, size)
        if why:
            log.warning("KV disk tier: %s is unusable (%s); computing the prompt instead", path, why)
            self.corrupt += 1
            self.remove(key)
            return None
        self._items.move_to_end(key)
        return blob[_HEADER:]

    @staticmethod
    def _check(blob: bytes, key: tuple[int, ...], size: int) -> str:
        if len(blob) != size:
            return f"{len(blob)} bytes, {size} written"
        if blob[:len(MAGIC)] != MAGIC:
            return "bad magic"
        if blob[len(MAGIC):len(MAGIC) + 32] != _key_digest(key):
            return "written for other tokens"
        if blob[len(MAGIC) + 32:_HEADER] != hashlib.sha256(memoryview(blob)[_HEADER:]).digest():
            return "checksum mismatch"
        return ""

    def remove(self, key: tuple[int, ...]) -> None:
        item = self._items.pop(key, None)
        if item is None:
            return
        path, size = item
        self.bytes -= size
        self.names.drop(key)
        path.unlink(missing_ok=True)

    def path_of(self, key: tuple[int, ...]) -> Path | None:
        item = self._items.get(key)
        return item[0] if item else None

    def close(self) -> None:
        self._items.clear()
        self.bytes = 0
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_dead_dirs(root: Path) -> None:
    """Remove the tier directories of processes that no longer exist (killed before they could clean up)."""
    for d in root.iterdir():
        m = _DIR.match(d.name)
        if not m or not d.is_dir():
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
