"""The configurations the distributed suite runs under, as the environment and flags every
``dynamo-run`` process of a test gets.

``etcd+nats``: etcd for discovery, NATS for requests and events (the original's layout).
``file+tcp+zmq``: nothing started: the file discovery store (a fresh ``DYN_FILE_KV`` directory per
configuration), the TCP request plane and the ZMQ event plane; the model cards' files go in the file
object store. What a user with neither etcd nor NATS gets by default, said explicitly here so that an
etcd or NATS left running on the default ports by something else cannot change what is tested.
``etcd+tcp+zmq``: etcd for discovery, the TCP request plane and the ZMQ event plane, no NATS server: the
planes that need no server under a discovery store that can go away (the etcd chaos tests kill it, see
:data:`ETCD_CONFIGS`).

Use the ``dist_config`` fixture (tests/e2e/conftest.py): a module-scoped fixture parametrized over
:data:`DIST_CONFIGS`, so a module's fleet is started once per configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from dynamo.runtime.config import EtcdSettings
from dynamo.runtime.discovery import Discovery
from dynamo.runtime.etcd import EtcdClient
from dynamo.runtime.file_store import FileStore
from harness.servers import EtcdServer, NatsServer

T = TypeVar("T")

DIST_CONFIGS = ("etcd+nats", "file+tcp+zmq")
# the configurations with an etcd to kill: the etcd chaos tests run under both
ETCD_CONFIGS = ("etcd+nats", "etcd+tcp+zmq")


@dataclass
class DistConfig:
    name: str
    env: dict[str, str]
    flags: list[str]  # given to every dynamo-run worker and frontend
    etcd: EtcdServer | None = None
    nats: NatsServer | None = None
    file_kv: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def discovery(self) -> str:
        return self.name.split("+")[0]

    # -- the discovery store as the processes see it, through the runtime's own clients (a test looks at
    #    or plants registrations the same way under either backend)

    def _with_store(self, op: Callable[[Discovery], Awaitable[T]]) -> T:
        async def run() -> T:
            store: FileStore | EtcdClient
            if self.file_kv is not None:
                store = FileStore(self.file_kv)
            else:
                assert self.etcd is not None
                store = EtcdClient(EtcdSettings([self.etcd.url]))
            await store.connect()
            try:
                return await op(store)
            finally:
                await store.close()

        return asyncio.run(run())

    def keys(self, prefix: str) -> dict[str, tuple[Any, int]]:
        """``{key: (json value, lease id)}`` of every live key under ``prefix``."""
        async def op(store: Discovery) -> dict[str, tuple[Any, int]]:
            return {kv.key: (json.loads(kv.value) if kv.value else None, kv.lease)
                    for kv in await store.get_prefix(prefix)}
        return self._with_store(op)

    def put(self, key: str, value: str) -> None:
        async def op(store: Discovery) -> None:
            await store.put(key, value.encode())
        self._with_store(op)

    def delete(self, key: str) -> None:
        async def op(store: Discovery) -> None:
            await store.delete(key)
        self._with_store(op)


@contextlib.contextmanager
def dist_config(name: str, workdir: Path, *, lease_ttl: int = 3) -> Iterator[DistConfig]:
    """Start what configuration ``name`` needs; the env carries a short lease TTL so that a killed
    worker's registration goes within seconds."""
    base = {"DYN_LEASE_TTL": str(lease_ttl)}
    with contextlib.ExitStack() as stack:
        if name == "etcd+nats":
            etcd = stack.enter_context(EtcdServer())
            nats = stack.enter_context(NatsServer())
            yield DistConfig(name, {**base, "ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url},
                             ["--discovery-backend", "etcd"], etcd=etcd, nats=nats)
        elif name == "etcd+tcp+zmq":
            etcd = stack.enter_context(EtcdServer())
            yield DistConfig(name, {**base, "ETCD_ENDPOINTS": etcd.url, "DYN_DISCOVERY_BACKEND": "etcd",
                                    "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"},
                             ["--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "zmq"],
                             etcd=etcd)
        elif name == "file+tcp+zmq":
            kv = workdir / "dynamo_store_kv"
            yield DistConfig(name, {**base, "DYN_FILE_KV": str(kv), "DYN_DISCOVERY_BACKEND": "file",
                                    "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"},
                             ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"],
                             file_kv=kv)
        else:
            raise ValueError(f"unknown distributed configuration {name!r}; known: {', '.join(DIST_CONFIGS + ETCD_CONFIGS[1:])}")
