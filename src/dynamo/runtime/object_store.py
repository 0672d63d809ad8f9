"""The object store: named blobs too big for a discovery value (a model's tokenizer is megabytes; etcd
values are limited to about 1.5 MB), shared by every process of a namespace.

Names are content hashes in practice, so a put of a name that exists is a no-op and readers check what
they get.  NATS JetStream's object store (:mod:`.nats_object_store`) is the first implementation.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .errors import DynamoRuntimeError


class ObjectStoreError(DynamoRuntimeError):
    """The store cannot be used (for NATS: no JetStream), or the object is not there."""


@runtime_checkable
class ObjectStore(Protocol):
    async def put_if_absent(self, name: str, data: bytes) -> bool:
        """Store ``data`` under ``name`` unless that name exists; True when it was stored now."""

    async def get(self, name: str) -> bytes:
        """The object stored under ``name``; :class:`ObjectStoreError` when there is none."""


class MissingObjectStore:
    """The object store of a process with no server to keep one: every use is a clear
    :class:`ObjectStoreError` (a model whose card needs no object still registers)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def put_if_absent(self, name: str, data: bytes) -> bool:
        raise ObjectStoreError(self.reason)

    async def get(self, name: str) -> bytes:
        raise ObjectStoreError(self.reason)
