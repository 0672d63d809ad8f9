"""The object store in the discovery store itself (an :class:`~dynamo.runtime.object_store.ObjectStore`),
for a fleet on etcd with no NATS: a model card's tokenizer must reach a frontend on another machine,
and etcd is the one server every process of such a fleet already shares.

An object is split into chunks small enough for one etcd request (etcd refuses requests over 1.5 MiB by
default, and its JSON gateway sends values base64-encoded, a third larger): ``objects/<bucket>/<name>/
<index>``, then a ``objects/<bucket>/<name>`` record with the size, the chunk count and a SHA-256,
created last and only if absent, so a reader that finds the record finds every chunk, and two writers
of one name (names are content hashes) agree. Objects are bound to no lease: like NATS JetStream's,
they outlive the process that stored them, so a frontend that starts after the worker died still reads
the card it left. Why not have the worker serve its files to frontends instead: that would tie the
tokenizer to one worker's uptime and need a second request path; a tokenizer of a few megabytes is
small beside etcd's default quota of 2 GiB.
"""

from __future__ import annotations

import hashlib

import orjson

from .discovery import Discovery
from .object_store import ObjectStore, ObjectStoreError

CHUNK = 512 * 1024  # bytes per key: well under etcd's default 1.5 MiB request limit once base64-encoded
ROOT = "objects/"


class DiscoveryObjectStore:
    def __init__(self, store: Discovery, bucket: str) -> None:
        self.store = store
        self.bucket = bucket
        self.prefix = f"{ROOT}{bucket}/"

    async def put_if_absent(self, name: str, data: bytes) -> bool:
        record = self.prefix + name
        if await self.store.get(record) is not None:
            return False
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            await self.store.put(f"{record}/{index:06d}", chunk)
        meta = {"size": len(data), "chunks": len(chunks), "sha256": hashlib.sha256(data).hexdigest()}
        return await self.store.create(record, orjson.dumps(meta))

    async def get(self, name: str) -> bytes:
        record = self.prefix + name
        kv = await self.store.get(record)
        if kv is None:
            raise ObjectStoreError(f"no object {name!r} in the {self.bucket} object store (in the discovery store)")
        meta = orjson.loads(kv.value)
        parts = sorted(await self.store.get_prefix(record + "/"), key=lambda part: part.key)
        data = b"".join(part.value for part in parts[:meta["chunks"]])
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ObjectStoreError(f"object {name!r} in the {self.bucket} object store is incomplete or damaged")
        return data


class FallbackObjectStore:
    """Writes go to the first store; a read the first cannot answer (no such object, or its server is
    down) is asked of the next (a frontend with NATS reads a card that a worker without NATS left in
    etcd); the last one's error is the one reported."""

    def __init__(self, *stores: ObjectStore) -> None:
        self.stores = stores

    async def put_if_absent(self, name: str, data: bytes) -> bool:
        return await self.stores[0].put_if_absent(name, data)

    async def get(self, name: str) -> bytes:
        *others, last = self.stores
        for store in others:
            try:
                return await store.get(name)
            except Exception:  # noqa: BLE001 - not there, or that server is down: ask the next one
                continue
        return await last.get(name)
