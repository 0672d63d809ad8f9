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

from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Protocol, runtime_checkable

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
