"""Watches on the file store: one directory watcher per store, feeding every prefix watch made from it.

Changes arrive through ``watchfiles`` (inotify on Linux, FSEvents on macOS, through the Rust ``notify``
crate; a well-kept library rather than our own inotify bindings), debounced by a few milliseconds.
Where the platform cannot watch (inotify limits, some network or container file systems) the watcher
falls back to listing the directory every ``poll_interval`` seconds, and says so once.

A lease expires without touching any file (its owner just stops refreshing it), so the watcher also
ticks: every ``tick`` seconds it deletes expired leases and their keys (:meth:`FileKv.clean_up`) and
re-lists. Each wake-up lists the directory once (unchanged files are not read again) and every watch
emits the difference from what it emitted before, so deletes by revocation, by expiry, or by another
process's clean-up all reach the watchers the same way, and a burst of changes costs one listing.
"""

from __future__ import annotations

import asyncio
import logging

from dynamo.aio import cancel_and_wait

from .discovery import KeyValue, ListedWatch
from .file_kv import FileKv

log = logging.getLogger(__name__)

DEFAULT_TICK = 0.5  # seconds between lease-expiry checks (a dead owner's keys go within TTL + this)
DEBOUNCE_MS = 20


class FileWatch(ListedWatch):
    """A list-then-watch of a prefix in the file store (a :class:`~dynamo.runtime.discovery.DiscoveryWatch`)."""

    def __init__(self, watcher: "DirectoryWatcher", prefix: str) -> None:
        super().__init__(prefix)
        self._watcher = watcher

    async def start(self) -> "FileWatch":
        if self._started:
            return self
        self._started = True
        self._watcher.add(self)  # before listing: a change during the listing is caught by the next scan
        kvs, _ = await self._watcher.list_prefix(self.prefix)
        self._emit_listing(kvs)
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._watcher.discard(self)
        self._end()

    def update(self, snapshot: list[KeyValue], revision: int) -> None:
        """Emit the difference between ``snapshot`` (every live key) and what was emitted."""
        if not self._started or self._closed:
            return
        self._emit_difference({kv.key: kv for kv in snapshot if kv.key.startswith(self.prefix)}, revision)


class DirectoryWatcher:
    """Wakes on file changes (or polls) and on a tick, cleans up expired leases, updates every watch."""

    def __init__(self, kv: FileKv, *, tick: float = DEFAULT_TICK, poll_interval: float | None = None) -> None:
        self.kv = kv
        self.tick = tick
        self.poll_interval = poll_interval  # None: file events (polling only if they are unavailable)
        self.mode = "poll" if poll_interval else "events"
        self._watches: set[FileWatch] = set()
        self._dirty = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.scans = 0  # listings done (tests and diagnostics)

    def add(self, watch: FileWatch) -> None:
        self._watches.add(watch)
        if not self._tasks:
            self._start()

    def discard(self, watch: FileWatch) -> None:
        self._watches.discard(watch)

    async def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return await asyncio.to_thread(self.kv.get_prefix_with_revision, prefix)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name="file-store-watch"),
                       loop.create_task(self._ticks(), name="file-store-tick")]
        if self.poll_interval is None:
            self._tasks.append(loop.create_task(self._file_events(), name="file-store-events"))

    async def _ticks(self) -> None:
        period = min(self.tick, self.poll_interval) if self.poll_interval else self.tick
        while True:
            await asyncio.sleep(period)
            self._dirty.set()

    async def _file_events(self) -> None:
        import watchfiles  # the Rust notify watcher; imported only by processes that watch

        try:
            # our keys, and the v1/ buckets that Dynamo 1.x processes write too (one made later by another
            # process is seen at the next tick)
            paths = [self.kv.keys_dir, *self.kv.v1.bucket_dirs()]
            async for _changes in watchfiles.awatch(*paths, debounce=DEBOUNCE_MS, step=10,
                                                    stop_event=self._stop, watch_filter=None, recursive=False):
                self._dirty.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no inotify (limits, file system): poll instead
            self.poll_interval = self.tick = min(self.tick, 0.25)
            self.mode = "poll"
            log.warning("file store %s: cannot watch for changes (%s); polling every %.2fs instead",
                        self.kv.root, exc, self.poll_interval)

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await asyncio.to_thread(self.kv.clean_up)
                snapshot, revision = await self.list_prefix("")
            except OSError as exc:  # the directory went away or is unreadable: keep what is known, retry
                log.warning("file store %s: listing failed (%s); retrying", self.kv.root, exc)
                await asyncio.sleep(self.tick)
                self._dirty.set()
                continue
            self.scans += 1
            for watch in list(self._watches):
                watch.update(snapshot, revision)

    async def close(self) -> None:
        self._stop.set()  # ends the watchfiles thread within its step
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []
        for watch in list(self._watches):
            await watch.close()

