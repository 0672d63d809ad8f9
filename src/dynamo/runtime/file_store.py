"""Discovery on a directory shared by the processes of one host: the ``file`` implementation of
:class:`~dynamo.runtime.discovery.Discovery`, so that a frontend finds its workers with no etcd to start.

The directory's format, locking and lease expiry are :mod:`.file_kv`; watches are :mod:`.file_watch`.
This class runs the directory work in worker threads (a file lock may wait on another process; the
event loop never does) and opens the store by deleting what crashed processes left behind.

Keys under ``v1/`` are Dynamo 1.x's records in 1.x's own files (:mod:`.file_v1`), so 1.6.1 processes
using the same directory and ours see each other; this class keeps the ones it wrote alive by touching
them every few seconds, as 1.x does, for as long as their lease lives.

One host only: the lock is ``flock`` and expiry compares wall clocks, neither of which holds across
machines (or on most network file systems). A fleet that spans hosts uses etcd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path

from dynamo.aio import cancel_and_wait

from .discovery import KeyValue
from .file_kv import FileKv, FileStoreError, check_writable
from .file_v1 import TOUCH_PERIOD, is_v1_key
from .file_watch import DEFAULT_TICK, DirectoryWatcher, FileWatch
from .store_dir import is_private_dir, local_secret, secure_store_dir

log = logging.getLogger(__name__)

__all__ = ["FileStore", "FileStoreError", "default_file_kv_dir"]


def default_file_kv_dir() -> Path:
    """``$DYN_FILE_KV``, else ``dynamo_store_kv`` in the temporary directory (``$TMPDIR``, else /tmp)."""
    return Path(os.environ.get("DYN_FILE_KV") or Path(tempfile.gettempdir()) / "dynamo_store_kv")


class FileStore:
    """Create, ``await connect()``, use, ``await close()``.

    ``root`` None: ``DYN_FILE_KV``, else the default directory. A directory named (``root`` given, or
    ``DYN_FILE_KV`` set) may belong to another user the caller trusts; the default may not
    (:func:`~dynamo.runtime.store_dir.secure_store_dir`).
    """

    def __init__(self, root: Path | str | None = None, *, tick: float = DEFAULT_TICK,
                 poll_interval: float | None = None) -> None:
        self.root = Path(root) if root is not None else default_file_kv_dir()
        self.explicit = root is not None or bool(os.environ.get("DYN_FILE_KV"))
        self._tick = tick
        self._poll_interval = poll_interval
        self._kv: FileKv | None = None
        self._watcher: DirectoryWatcher | None = None
        self._v1_keeper: asyncio.Task[None] | None = None
        self.private = False  # (connect) the directory is this user's alone: owned, 0700

    @property
    def kv(self) -> FileKv:
        if self._kv is None:
            raise FileStoreError("the file store is not open: await store.connect()")
        return self._kv

    @property
    def watcher(self) -> DirectoryWatcher:
        if self._watcher is None:
            self._watcher = DirectoryWatcher(self.kv, tick=self._tick, poll_interval=self._poll_interval)
        return self._watcher

    async def connect(self) -> None:
        """Open (creating, 0700) the directory, refusing one another user could have planted, and delete
        what crashed processes left: expired leases and their keys."""
        def open_store() -> tuple[FileKv, int, bool]:
            secure_store_dir(self.root, explicit=self.explicit)
            kv = FileKv(self.root)
            check_writable(self.root)
            return kv, kv.clean_up(), is_private_dir(self.root)

        self._kv, stale, self.private = await asyncio.to_thread(open_store)
        if stale:
            log.info("file store %s: removed %d key(s) of processes that stopped without deregistering",
                     self.root, stale)

    async def local_secret(self) -> bytes:
        """The secret only this user's processes sharing this (private) store can read
        (:func:`~dynamo.runtime.store_dir.local_secret`)."""
        if not self.private:
            raise FileStoreError(f"the file store {self.root} is not this user's alone: it keeps no secret")
        return await asyncio.to_thread(local_secret, self.root)

    async def close(self) -> None:
        await cancel_and_wait(self._v1_keeper)
        self._v1_keeper = None
        if self._watcher is not None:
            await self._watcher.close()
            self._watcher = None

    def _keep_v1(self, key: str) -> None:
        """A ``v1/`` key was written: make sure this process touches its files (1.x reads mtimes)."""
        if is_v1_key(key) and self._v1_keeper is None:
            self._v1_keeper = asyncio.get_running_loop().create_task(self._touch_v1(), name="file-store-v1-touch")

    async def _touch_v1(self) -> None:
        while True:
            await asyncio.sleep(TOUCH_PERIOD)
            try:
                await asyncio.to_thread(self.kv.touch_v1)
            except OSError as exc:  # the directory went away: keep trying, as the lease keeper does
                log.warning("file store %s: cannot keep the v1/ records alive (%s)", self.root, exc)

    # ---- keys
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._keep_v1(key)
        return await asyncio.to_thread(self.kv.put, key, value, lease)

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        self._keep_v1(key)
        return await asyncio.to_thread(self.kv.create, key, value, lease)

    async def put_if_changed(self, key: str, value: bytes, lease: int) -> bool:
        self._keep_v1(key)
        return await asyncio.to_thread(self.kv.put_if_changed, key, value, lease)

    async def get(self, key: str) -> KeyValue | None:
        return await asyncio.to_thread(self.kv.get, key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return (await asyncio.to_thread(self.kv.get_prefix_with_revision, prefix))[0]

    async def delete(self, key: str) -> int:
        return await asyncio.to_thread(self.kv.delete, key)

    async def delete_prefix(self, prefix: str) -> int:
        return await asyncio.to_thread(self.kv.delete_prefix, prefix)

    # ---- leases
    async def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        return await asyncio.to_thread(self.kv.grant_lease, ttl, lease_id)

    async def keep_alive(self, lease_id: int) -> tuple[int, int]:
        return await asyncio.to_thread(self.kv.keep_alive, lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        await asyncio.to_thread(self.kv.revoke_lease, lease_id)

    # ---- watches
    def watch_prefix(self, prefix: str) -> FileWatch:
        return FileWatch(self.watcher, prefix)
