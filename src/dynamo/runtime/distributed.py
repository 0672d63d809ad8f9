"""DistributedRuntime: one process's connections, its primary lease (= instance id), the keys bound to
that lease, and its shutdown signal.

This is where the backends are chosen and wired: etcd behind the discovery seam
(:mod:`.discovery`), NATS or direct TCP behind the request plane (:mod:`.request_plane`), NATS or ZMQ
behind the event plane (:mod:`.event_plane`), TCP call-home for response streams
(:mod:`.response_streams`). The planes' rule, in one block of ``_open``: what ``DYN_REQUEST_PLANE`` /
``DYN_EVENT_PLANE`` (``--request-plane`` / ``--event-plane``) say; where either is not given, NATS when a
server answers at ``NATS_SERVER``, else TCP and ZMQ; one log line says what was chosen. With TCP and
ZMQ, NATS is still used for the object store when a server answers. Everything else
gets those parts through the accessors (``discovery()``, ``request_plane()``, ``event_plane()``,
``response_streams()``), never a backend's module.

Every key written under the primary lease through ``discovery()`` (instance records by
``serve_endpoint``, model entries by ``register_llm``, anything a user puts with ``lease=True``) is
remembered, so that when the store comes back without them (the lease expired during an outage, it was
wiped or restored from an old snapshot) the runtime writes them again; see :mod:`.lease` and
:mod:`.kv_store`.

Create with ``runtime = await DistributedRuntime.connect()`` (or let ``@dynamo_worker`` do it);
``runtime.shutdown()`` starts a graceful shutdown; ``await runtime.close()`` finishes it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient

from .component import Namespace
from .config import EVENT_PLANES, REQUEST_PLANES, RuntimeSettings, check_choice
from .errors import DynamoRuntimeError, RuntimeConfigError, RuntimeConnectionError
from .etcd import EtcdClient
from .event_plane import EventPlane
from .kv_store import KeyValueStore
from .lease import LeaseKeeper
from .names import lease_hex
from .nats_conn import connect_nats
from .nats_event_plane import NatsEventPlane
from .nats_object_store import NatsObjectStore
from .nats_request_plane import NatsRequestPlane
from .object_store import MissingObjectStore, ObjectStore
from .request_plane import RequestPlane
from .response_streams import ResponseStreams
from .tcp_request_plane import TcpRequestPlane

if TYPE_CHECKING:
    from .system_server import SystemStatusServer
    from .zmq_event_plane import ZmqEventPlane

log = logging.getLogger(__name__)

NATS_PROBE_TIMEOUT = 1.0  # a NATS that does not answer within this is taken as absent when it is optional


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
        self.nats: NatsClient = None  # type: ignore[assignment]  # stays None without NATS
        self.primary_lease_id = 0
        self._lease: LeaseKeeper | None = None
        self._shutdown = asyncio.Event()
        self._closed = False
        self._requests: RequestPlane | None = None
        self._events: EventPlane | None = None
        self._zmq_events: "ZmqEventPlane | None" = None  # the event plane again, when it is ZMQ's (to close)
        self._object_stores: dict[str, ObjectStore] = {}
        self._streams: ResponseStreams | None = None
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
        if self._requests is None:
            await self._open()
        return self

    async def _open(self) -> None:
        try:
            if not self.is_static:
                self.etcd_client = EtcdClient(self.settings.etcd)
                await self.etcd_client.connect()
                self.etcd = KeyValueStore(self.etcd_client, lambda: self.primary_lease_id, self._shutdown.is_set)
            # ---- the request and event planes: which ones, and whether NATS is needed at all
            settings = self.settings
            requests, events = settings.request_plane, settings.event_plane
            if self.is_static:  # no discovery to find a TCP listener or a ZMQ publisher in
                requests, events = requests or "nats", events or "nats"
            nc: NatsClient | None
            if requests == "tcp" and events == "zmq":  # NATS only for the object store (model cards), if up
                nc = await self._try_nats()
            elif requests is None or events is None:  # NATS when it answers, else TCP and ZMQ
                nc = await self._try_nats()
                requests = requests or ("nats" if nc is not None else "tcp")
                events = events or ("nats" if nc is not None else "zmq")
                if nc is None and "nats" in (requests, events):
                    nc = await connect_nats(settings.nats, name=f"dynamo-{lease_hex(0)}")  # the error
            else:
                nc = await connect_nats(settings.nats, name=f"dynamo-{lease_hex(0)}")
            self.nats = nc  # type: ignore[assignment]  # None: no NATS (TCP and ZMQ planes)
            if self.is_static and (requests, events) != ("nats", "nats"):
                raise RuntimeConfigError("a static runtime (no discovery) needs the NATS request and event planes")
            # either way a client reaches the workers of both planes (by their instance records' address)
            self._requests = TcpRequestPlane(settings.tcp_host, settings.tcp_rpc_port,
                                             fallback=NatsRequestPlane(self.nats) if self.nats is not None else None,
                                             serve_on_fallback=requests == "nats")
            log.info("request plane %s, event plane %s%s", requests, events,
                     "" if self.nats is not None else " (no NATS server: none is needed)")
            # ---- end of the plane choice
            self._streams = ResponseStreams(settings, self.nats)
            if self.etcd is not None:
                self._lease = LeaseKeeper(self.etcd.client, settings.lease_ttl, on_restored=self.etcd.republish)
                self.primary_lease_id = await self._lease.start()
            if events == "zmq":
                from .zmq_event_plane import ZmqEventPlane  # pyzmq: imported only by processes that use it

                assert self.etcd is not None
                zmq_plane = ZmqEventPlane(self.etcd, settings.tcp_host)
                self._zmq_events = zmq_plane
                self._events = zmq_plane
                await zmq_plane.start_publisher(self.primary_lease_id)
            else:
                assert self.nats is not None
                self._events = NatsEventPlane(self.nats)
            if self.settings.system.enabled:
                from .system_server import SystemStatusServer  # aiohttp.web, prometheus_client: only when on

                self.system = SystemStatusServer(self.settings.system)
                await self.system.start()
        except BaseException:
            await self._close_connections()
            raise

    async def _try_nats(self) -> NatsClient | None:
        """A NATS connection if a server answers at the configured address, else None (no error)."""
        try:
            return await connect_nats(self.settings.nats, name=f"dynamo-{lease_hex(0)}", timeout=NATS_PROBE_TIMEOUT)
        except RuntimeConnectionError as exc:
            log.debug("no NATS: %s", exc)
            return None

    @property
    def instance_id(self) -> int:
        return self.primary_lease_id

    @property
    def instance_hex(self) -> str:
        return lease_hex(self.primary_lease_id)

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, name)

    # ------------------------------------------------------------------ the seams

    def discovery(self) -> KeyValueStore:
        """Who is alive: keys with the primary lease (``lease=True``), listings, watches."""
        if self.etcd is None:
            raise DynamoRuntimeError("a static runtime has no discovery store")
        return self.etcd

    def request_plane(self) -> RequestPlane:
        """Requests to an instance and their acks; serving endpoints."""
        if self._requests is None:
            raise _not_connected()
        return self._requests

    def event_plane(self) -> EventPlane:
        """Publishing and subscribing to events (KV events, metrics)."""
        if self._events is None:
            raise _not_connected()
        return self._events

    def object_store(self, bucket: str) -> ObjectStore:
        """Named blobs shared by the namespace's processes (a model's tokenizer), in ``bucket``."""
        if self.nats is None:
            if self._requests is None:
                raise _not_connected()
            # connected, on the TCP and ZMQ planes with no NATS server
            return MissingObjectStore(f"no NATS server at {self.settings.nats.server}: the object store "
                                      "(a model card's tokenizer) needs one")
        store = self._object_stores.get(bucket)
        if store is None:  # one handle per bucket: it opens (or creates) the bucket once, on first use
            store = self._object_stores[bucket] = NatsObjectStore(self.nats, bucket)
        return store

    def response_streams(self) -> ResponseStreams:
        """Where this process's response streams arrive, and how it sends streams back."""
        if self._streams is None:
            raise _not_connected()
        return self._streams

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

    @property
    def lease_keys(self) -> dict[str, bytes]:
        """The keys this process keeps registered under its primary lease (a copy)."""
        return dict(self.etcd.lease_keys) if self.etcd is not None else {}

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
        if self._streams is not None:
            await self._streams.close()
        if self._requests is not None:
            await self._requests.close()
        if self._zmq_events is not None:
            await self._zmq_events.close()
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


def _not_connected() -> DynamoRuntimeError:
    return DynamoRuntimeError("runtime is not connected: await DistributedRuntime.connect() (or rt.start())")


async def connect_runtime(*, request_plane: str | None = None, event_plane: str | None = None) -> DistributedRuntime:
    """Connect with the settings in the environment, for a command-line process: a bad setting or an
    unreachable etcd / NATS is a one-line :class:`UserError`, not a traceback. ``request_plane`` and
    ``event_plane`` (the command line's) win over the environment's."""
    from dynamo.errors import UserError

    try:
        settings = RuntimeSettings.from_env()
        settings.request_plane = check_choice("--request-plane", request_plane, REQUEST_PLANES) or settings.request_plane
        settings.event_plane = check_choice("--event-plane", event_plane, EVENT_PLANES) or settings.event_plane
        return await DistributedRuntime.connect(settings)
    except (RuntimeConnectionError, RuntimeConfigError) as e:
        raise UserError(str(e)) from None
