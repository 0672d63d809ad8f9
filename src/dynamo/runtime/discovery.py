"""Discovery: the interface to the store that says who is alive, whatever backs it.

Workers register keys bound to a lease (their instance records, their model entries); the keys go when
the lease is revoked or expires, so a dead process disappears by itself. Clients list a prefix and watch
it. etcd (:mod:`.etcd`, :mod:`.etcd_watch`) is the first implementation; a store without a server (files
on a shared disk) is meant to fit the same interface, which is why it holds only these operations:

* values are bytes; keys are strings; a lease is an integer id (0: none) that the store grants and that
  its holder keeps alive; the process's primary lease id is its instance id, so a store must grant a
  requested id again after it lost it (an instance keeps its identity across a store outage).
* a watch is an async iterator of put/delete events: first the keys that exist (``initial=True``), then
  changes. It never ends by itself: when it loses the store's history (compaction, a wiped or restored
  store, an outage) it lists the prefix again and emits the difference.

The rest of the runtime and the LLM layer above it use :class:`Discovery` (through the runtime's
lease-aware :class:`~dynamo.runtime.kv_store.KeyValueStore`), never a backend's module.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Generator, Literal, Protocol, runtime_checkable

import orjson


@dataclass(slots=True)
class KeyValue:
    """One key as the store holds it (revisions and version as the store counts them; 0 when it does not)."""

    key: str
    value: bytes
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0

    def json(self) -> Any:
        return orjson.loads(self.value)


@dataclass(slots=True)
class WatchEvent:
    """One change under a watched prefix. ``initial`` marks events synthesised from the first listing."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    lease: int = 0
    initial: bool = False

    PUT = "put"
    DELETE = "delete"

    def json(self) -> Any:
        return orjson.loads(self.value)


def encode_value(value: bytes | str | dict | list) -> bytes:
    """A value as the store keeps it: bytes as they are, text as UTF-8, anything else as JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return orjson.dumps(value)


@runtime_checkable
class DiscoveryWatch(Protocol):
    """A running list-then-watch of a prefix. ``await watch.start()`` lists (``initial``) and starts
    watching; iterating yields the listing as ``initial`` put events, then every change."""

    prefix: str
    initial: list[KeyValue]

    async def start(self) -> "DiscoveryWatch": ...

    def __aiter__(self) -> AsyncIterator[WatchEvent]: ...

    async def __anext__(self) -> WatchEvent: ...

    async def close(self) -> None:
        """Stop watching; the iterator ends."""


class ListedWatch:
    """What every backend's :class:`DiscoveryWatch` shares: the queue of events, the keys as last emitted,
    the iterator, and the re-listing that emits only the difference (a backend whose history breaks, or
    that has none, catches up that way). A backend adds ``start`` (list, :meth:`_emit_listing`, watch) and
    ``close`` (stop, :meth:`_end`); it may queue an exception, which the iterator raises."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.initial: list[KeyValue] = []
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        self._known: dict[str, tuple[bytes, int]] = {}  # key -> (value, lease) as last emitted
        self._started = False
        self._closed = False

    async def start(self) -> "ListedWatch":
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def __await__(self) -> Generator[Any, None, "ListedWatch"]:
        return self.start().__await__()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        if not self._started:
            await self.start()
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def __aenter__(self) -> "ListedWatch":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _emit_listing(self, kvs: list[KeyValue]) -> None:
        """The first listing: ``initial``, and a put event marked ``initial`` for each key."""
        self.initial = kvs
        for kv in kvs:
            self._known[kv.key] = (kv.value, kv.lease)
            self._queue.put_nowait(WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease, initial=True))

    def _emit_put(self, key: str, value: bytes, revision: int, lease: int) -> None:
        self._known[key] = (value, lease)
        self._queue.put_nowait(WatchEvent("put", key, value, revision, lease))

    def _emit_delete(self, key: str, revision: int) -> None:
        self._known.pop(key, None)
        self._queue.put_nowait(WatchEvent("delete", key, b"", revision))

    def _emit_difference(self, current: dict[str, KeyValue], revision: int,
                         gone: Callable[[str, int], None] | None = None) -> None:
        """Emit what changed between the keys last emitted and ``current`` (a fresh listing): a put for
        each new or changed key, and ``gone(key, revision)`` (by default a delete event) for each key that
        is no longer there."""
        on_gone = gone or self._emit_delete
        for key in [k for k in self._known if k not in current]:
            on_gone(key, revision)
        for key, kv in current.items():
            if self._known.get(key) != (kv.value, kv.lease):
                self._emit_put(key, kv.value, kv.mod_revision, kv.lease)

    def _end(self) -> None:
        """The iterator ends once it has yielded what is queued."""
        self._closed = True
        self._queue.put_nowait(None)


@runtime_checkable
class Discovery(Protocol):
    """Keys with leases, prefix listings and prefix watches. Every call may raise
    :class:`~dynamo.runtime.errors.RuntimeConnectionError` while the store is unreachable."""

    # ---- keys
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key`` (bound to ``lease`` unless 0); returns the store's revision."""

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Create-if-absent; True if this call created the key (an existing key is left untouched)."""

    async def put_if_changed(self, key: str, value: bytes, lease: int) -> bool:
        """Write ``key`` unless it already holds ``value`` under ``lease`` (watchers see no event for
        nothing); True if it wrote."""

    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    async def delete(self, key: str) -> int:
        """How many keys went (0 or 1)."""

    async def delete_prefix(self, prefix: str) -> int: ...

    # ---- leases
    async def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        """Grant a lease of ``ttl`` seconds; ``lease_id`` asks for that id (0: the store picks)."""

    async def keep_alive(self, lease_id: int) -> tuple[int, int]:
        """Refresh a lease: (remaining TTL, store revision). TTL 0: the store no longer knows it."""

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys (an unknown lease is not an error)."""

    # ---- watches
    def watch_prefix(self, prefix: str) -> DiscoveryWatch:
        """A list-then-watch of ``prefix`` (not started: ``await w.start()``, or iterate)."""

    async def close(self) -> None:
        """Release the connection; every watch made from it ends."""
