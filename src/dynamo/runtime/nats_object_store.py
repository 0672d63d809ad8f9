"""The object store on NATS JetStream (the first :class:`~dynamo.runtime.object_store.ObjectStore`): one
bucket, created on first use; nats-server must run with JetStream (``-js``), as ``dynamo-run-infra``
starts it."""

from __future__ import annotations

from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore as JsObjectStore

from .object_store import ObjectStoreError


class NatsObjectStore:
    def __init__(self, nc: NatsClient, bucket: str) -> None:
        self.nc = nc
        self.bucket = bucket
        self._store: JsObjectStore | None = None

    async def _bucket(self) -> JsObjectStore:
        if self._store is None:
            js = self.nc.jetstream()
            try:
                self._store = await js.object_store(self.bucket)
            except Exception:  # not created yet
                try:
                    self._store = await js.create_object_store(self.bucket)
                except Exception as e:
                    raise ObjectStoreError(f"cannot use the NATS JetStream object store ({e}); is nats-server "
                                           "running with JetStream enabled (nats-server -js)?") from None
        return self._store

    async def put_if_absent(self, name: str, data: bytes) -> bool:
        store = await self._bucket()
        try:
            await store.get_info(name)
            return False
        except (NotFoundError, ObjectNotFoundError):
            await store.put(name, data)
            return True

    async def get(self, name: str) -> bytes:
        store = await self._bucket()
        try:
            result = await store.get(name)
        except (NotFoundError, ObjectNotFoundError):
            raise ObjectStoreError(f"no object {name!r} in the {self.bucket} object store") from None
        return bytes(result.data or b"")
