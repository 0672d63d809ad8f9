"""The runtime's key-value store, as the LLM layer and user code see it (``runtime.discovery()``, also
``runtime.etcd``): any :class:`~dynamo.runtime.discovery.Discovery` store, with values given as bytes,
text or JSON-able objects, and ``lease=True`` for this process's primary lease.

Every key written under the primary lease through it (instance records by ``serve_endpoint``, model
entries by ``register_llm``, anything a user puts with ``lease=True``) is remembered in writing order,
so that when the store comes back without them (the lease expired during an outage, the store was wiped
or restored from an old snapshot) they are written again (:meth:`KeyValueStore.republish`, called by
the lease keeper, :mod:`.lease`).
"""

from __future__ import annotations

from typing import Any, Callable

from .discovery import Discovery, DiscoveryWatch, KeyValue, encode_value


class KeyValueStore:
    def __init__(self, client: Discovery, primary_lease: Callable[[], int],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.client = client
        self._primary_lease = primary_lease  # the runtime's primary lease id (it is granted after we exist)
        self._stopping = stopping  # True once shutdown started: nothing is re-published then
        # key -> value of every key written under the primary lease, in writing order (instance keys
        # before the model entries that point at them): what is re-published after the store lost them
        self.lease_keys: dict[str, bytes] = {}

    def _lease(self, lease: bool | int) -> int:
        if lease is True:
            return self._primary_lease()
        return int(lease or 0)

    def _track(self, key: str, value: bytes, lease_id: int) -> None:
        if lease_id and lease_id == self._primary_lease():
            self.lease_keys[key] = value
        else:
            self.lease_keys.pop(key, None)  # overwritten without our lease: no longer ours to restore

    async def put(self, key: str, value: Any, *, lease: bool | int = False) -> int:
        """Write (overwrite) ``key``; returns the revision. Under the primary lease it is re-published
        if the store loses it."""
        lease_id = self._lease(lease)
        raw = encode_value(value)
        self._track(key, raw, lease_id)
        return await self.client.put(key, raw, lease_id)

    async def create(self, key: str, value: Any, *, lease: bool | int = False) -> bool:
        """Create-if-absent; True if created, False if the key already existed (left untouched)."""
        lease_id = self._lease(lease)
        raw = encode_value(value)
        created = await self.client.create(key, raw, lease_id)
        if created:
            self._track(key, raw, lease_id)
        return created

    async def get(self, key: str) -> KeyValue | None:
        return await self.client.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return await self.client.get_prefix(prefix)

    async def delete(self, key: str) -> int:
        self.lease_keys.pop(key, None)
        return await self.client.delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        for key in [k for k in self.lease_keys if k.startswith(prefix)]:
            del self.lease_keys[key]
        return await self.client.delete_prefix(prefix)

    def watch_prefix(self, prefix: str) -> DiscoveryWatch:
        """Existing keys first (put events with ``initial=True``), then live put/delete events."""
        return self.client.watch_prefix(prefix)

    async def republish(self, reason: str = "") -> int:
        """Write back every key of the primary lease that the store lost or holds differently; how many
        were written. Never while shutting down: a worker going away must stay deregistered."""
        written = 0
        lease_id = self._primary_lease()
        for key, value in list(self.lease_keys.items()):
            if self._stopping():
                break
            if key in self.lease_keys and await self.client.put_if_changed(key, value, lease_id):
                written += 1
        return written
