"""DistributedRuntime: one process's connections (etcd + NATS), its primary lease (= instance id),
the keys bound to that lease, and its shutdown signal.

Every key written under the primary lease through the runtime (instance records by ``serve_endpoint``,
model entries by ``register_llm``, anything a user puts with ``lease=True``) is remembered, so that when
etcd comes back without them (the lease expired during an outage, etcd was wiped or restored from an old
snapshot) the runtime writes them again; see :mod:`dynamo.runtime.lease`.

Create with ``runtime = await DistributedRuntime.connect()`` (or let ``@dynamo_worker`` do it);
``runtime.shutdown()`` starts a graceful shutdown; ``await runtime.close()`` finishes it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient

from .ack import RequestSender
from .component import Namespace
from .config import RuntimeSettings
from .errors import DynamoRuntimeError, RuntimeConfigError, RuntimeConnectionError
from .etcd import EtcdClient, KeyValue, PrefixWatch, _to_bytes
from .ingress import open_tcp_sink
from .lease import LeaseKeeper
from .mux import INFO_KEY as MUX_INFO_KEY
from .mux import MuxPool
from .names import lease_hex
from .nats_conn import connect_nats
from .nats_stream import NatsResponseReceiver, NatsSinkHub
from .tcp import TRANSPORT_NAME as TCP_TRANSPORT
from .tcp import TcpResponseServer
from .transport import StreamState

if TYPE_CHECKING:
    from .system_server import SystemStatusServer

log = logging.getLogger(__name__)


class KeyValueStore:
    """etcd as the LLM layer sees it: values are bytes/str/JSON-able, ``lease=True`` binds a key to
    this process's primary lease (it vanishes when the process dies or shuts down)."""

    def __init__(self, client: EtcdClient, runtime: "DistributedRuntime") -> None:
        self.client = client
        self._runtime = runtime

    def _lease(self, lease: bool | int) -> int:
        if lease is True:
            return self._runtime.primary_lease_id
        return int(lease or 0)

    async def put(self, key: str, value: Any, *, lease: bool | int = False) -> int:
        """Write (overwrite) ``key``; returns the revision. Under the primary lease it is re-published
        if etcd loses it."""
        lease_id = self._lease(lease)
        raw = _to_bytes(value)
        self._runtime._track_key(key, raw, lease_id)
        return await self.client.put(key, raw, lease_id)

    async def create(self, key: str, value: Any, *, lease: bool | int = False) -> bool:
        """Create-if-absent; True if created, False if the key already existed (left untouched)."""
        lease_id = self._lease(lease)
        raw = _to_bytes(value)
        created = await self.client.create(key, raw, lease_id)
        if created:
            self._runtime._track_key(key, raw, lease_id)
        return created

    async def get(self, key: str) -> KeyValue | None:
        return await self.client.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return await self.client.get_prefix(prefix)

    async def delete(self, key: str) -> int:
        self._runtime._lease_keys.pop(key, None)
        return await self.client.delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        for key in [k for k in self._runtime._lease_keys if k.startswith(prefix)]:
            del self._runtime._lease_keys[key]
        return await self.client.delete_prefix(prefix)

    def watch_prefix(self, prefix: str) -> PrefixWatch:
        """Existing keys first (put events with ``initial=True``), then live put/delete events."""
        return self.client.watch_prefix(prefix)


class DistributedRuntime:
    def __init__(self, settings: RuntimeSettings | asyncio.AbstractEventLoop | None = None,
                 static: bool = False) -> None:
        """Not connected yet: use ``await DistributedRuntime.connect()``, or ``await rt.start()``.

        ``DistributedRuntime(loop, static)`` (the original binding's argument order) is accepted; the
        loop argument is ignored because the runtime always uses the running loop.
        """
        if isinstance(settings, asyncio.AbstractEventLoop):
            settings = None
        self.settings = settings or RuntimeSettings.from_env()
        self.is_static = static
        self.etcd_client: EtcdClient | None = None
        self.etcd: KeyValueStore | None = None
        self.nats: NatsClient = None  # type: ignore[assignment]
        self.primary_lease_id = 0
        self._lease: LeaseKeeper | None = None
        # key -> value of every key written under the primary lease, in writing order (instance keys
        # before the model entries that point at them): what is re-published after etcd lost them
        self._lease_keys: dict[str, bytes] = {}
        self._shutdown = asyncio.Event()
        self._closed = False
        self._services: dict[str, Any] = {}
        self._receiver: TcpResponseServer | NatsResponseReceiver | None = None
        self._nats_hub: NatsSinkHub | None = None
        self._mux_pool: MuxPool | None = None
        self._sender: RequestSender | None = None  # client: requests and their acks (runtime/ack.py)  # worker: multiplexed call-home connections (runtime/mux.py)
        self._shutdown_task: asyncio.Task | None = None
        # the worker's status server (DYN_SYSTEM_ENABLED / DYN_SYSTEM_PORT), None when off
        self.system: "SystemStatusServer | None" = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(cls, settings: RuntimeSettings | None = None, *, static: bool = False) -> "DistributedRuntime":
        """Connect to etcd (unless static) and NATS, and take the primary lease.

        Raises RuntimeConnectionError (one line, naming the address) within a few seconds when a server
        cannot be reached.
        """
        runtime = cls(settings, static=static)
        await runtime._open()
        return runtime

    @classmethod
    async def from_settings(cls, **kwargs: Any) -> "DistributedRuntime":
        return await cls.connect(**kwargs)

    async def start(self) -> "DistributedRuntime":
        """Connect a runtime built with the constructor (``connect()`` does both steps)."""
        if self.nats is None:
            await self._open()
        return self

    async def _open(self) -> None:
        try:
            if not self.is_static:
                self.etcd_client = EtcdClient(self.settings.etcd)
                await self.etcd_client.connect()
                self.etcd = KeyValueStore(self.etcd_client, self)
            self.nats = await connect_nats(self.settings.nats, name=f"dynamo-{lease_hex(0)}")
            if not self.is_static:
                assert self.etcd_client is not None
                self._lease = LeaseKeeper(self.etcd_client, self.settings.lease_ttl, on_restored=self._republish)
                self.primary_lease_id = await self._lease.start()
            if self.settings.system.enabled:
                from .system_server import SystemStatusServer  # aiohttp.web, prometheus_client: only when on

                self.system = SystemStatusServer(self.settings.system)
                await self.system.start()
        except BaseException:
            await self._close_connections()
            raise

    @property
    def instance_id(self) -> int:
        return self.primary_lease_id

    @property
    def instance_hex(self) -> str:
        return lease_hex(self.primary_lease_id)

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, name)

    def shutdown(self) -> None:
        """Begin a graceful shutdown (safe from signal handlers): revoke the lease so every key bound to
        it disappears, and let ``serve_endpoint`` calls drain and return."""
        if self._shutdown.is_set():
            return
        self._shutdown.set()
        if self.system is not None:
            self.system.draining = True  # /health says 503 from now on
        if self._lease is not None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self._lease.revoke())

    @property
    def is_shutting_down(self) -> bool:
        return self._shutdown.is_set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    def _track_key(self, key: str, value: bytes, lease_id: int) -> None:
        if lease_id and lease_id == self.primary_lease_id:
            self._lease_keys[key] = value
        else:
            self._lease_keys.pop(key, None)  # overwritten without our lease: no longer ours to restore

    @property
    def lease_keys(self) -> dict[str, bytes]:
        """The keys this process keeps registered under its primary lease (a copy)."""
        return dict(self._lease_keys)

    async def _republish(self, reason: str) -> int:
        """Write back every key of the primary lease that etcd lost or holds differently; how many were
        written. Never while shutting down: a worker going away must stay deregistered."""
        assert self.etcd_client is not None
        written = 0
        for key, value in list(self._lease_keys.items()):
            if self._shutdown.is_set():
                break
            if key in self._lease_keys and await self.etcd_client.put_if_changed(key, value, self.primary_lease_id):
                written += 1
        return written

    async def close(self) -> None:
        """Shut down (if not yet) and release everything: lease revoked, connections closed."""
        if self._closed:
            return
        self.shutdown()
        if self._shutdown_task is not None:
            try:
                await self._shutdown_task
            except Exception as exc:  # noqa: BLE001 - etcd may be gone; the lease then expires by itself
                log.debug("lease revoke failed: %s", exc)
        self._closed = True
        await self._close_connections()

    async def _close_connections(self) -> None:
        if self.system is not None:
            await self.system.close()
        if self._lease is not None:
            await self._lease.stop()
        if self._receiver is not None:
            await self._receiver.close()
            self._receiver = None
        if self._nats_hub is not None:
            await self._nats_hub.close()
            self._nats_hub = None
        if self._mux_pool is not None:
            self._mux_pool.close()
            self._mux_pool = None
        for service in list(self._services.values()):
            try:
                await service.stop()
            except Exception:  # noqa: BLE001
                pass
        self._services.clear()
        if self.nats is not None and not self.nats.is_closed:
            try:
                await self.nats.close()
            except Exception:  # noqa: BLE001
                pass
        if self.etcd_client is not None:
            await self.etcd_client.close()

    async def __aenter__(self) -> "DistributedRuntime":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ transport plumbing

    async def _response_receiver(self) -> TcpResponseServer | NatsResponseReceiver:
        """This process's receiver of response streams (created on first use; kind per settings)."""
        if self._closed:
            raise DynamoRuntimeError("runtime is closed")
        receiver = self._receiver
        if receiver is None:
            if self.settings.response_transport == "nats":
                receiver = NatsResponseReceiver(self.nats, self.settings.stream_liveness)
            else:
                receiver = TcpResponseServer(self.settings.tcp_host, self.settings.stream_liveness,
                                             mux=self.settings.tcp_mux)
            self._receiver = receiver
        if not receiver.address:
            await receiver.start()
        return receiver

    def _request_sender(self) -> RequestSender:
        if self._sender is None:
            self._sender = RequestSender(self.nats)
        return self._sender

    def _sink_openers(self) -> dict:
        """Worker side: how to open a response stream for each transport a client may ask for."""

        async def open_nats(transport: str, info: dict, context: Any) -> Any:
            if self._nats_hub is None:
                self._nats_hub = NatsSinkHub(self.nats)
            return await self._nats_hub.open(transport, info, context)

        async def open_tcp(transport: str, info: dict, context: Any) -> Any:
            mux_id = info.get(MUX_INFO_KEY)
            if type(mux_id) is int and mux_id > 0 and self.settings.tcp_mux:  # the client offers multiplexing
                if self._mux_pool is None:
                    self._mux_pool = MuxPool()
                heartbeat_ms = info.get("heartbeat_ms")
                conn = await self._mux_pool.get(str(info["address"]),
                                                heartbeat_ms if type(heartbeat_ms) is int and heartbeat_ms > 0 else None)
                return conn.open(mux_id, context)
            return await open_tcp_sink(transport, info, context)

        return {"nats": open_nats, TCP_TRANSPORT: open_tcp}

    def _on_instance_gone(self, instance_id: int, states: list[StreamState]) -> None:
        if self._receiver is not None and states:
            self._receiver.on_instance_gone(states)


async def connect_runtime() -> DistributedRuntime:
    """Connect with the settings in the environment, for a command-line process: a bad setting or an
    unreachable etcd / NATS is a one-line :class:`UserError`, not a traceback."""
    from dynamo.errors import UserError

    try:
        return await DistributedRuntime.connect()
    except (RuntimeConnectionError, RuntimeConfigError) as e:
        raise UserError(str(e)) from None
