"""DistributedRuntime: one process's connections, its primary lease (= instance id), the keys bound to
that lease, and its shutdown signal.

This is where the backends are chosen and wired: etcd or the file store behind the discovery seam
(:mod:`.discovery`), NATS or direct TCP behind the request plane (:mod:`.request_plane`), NATS or ZMQ
behind the event plane (:mod:`.event_plane`), NATS JetStream, files or etcd behind the object store
(:mod:`.object_store`), TCP call-home for response streams (:mod:`.response_streams`). The default
rule (:mod:`.discovery_choice` for discovery, :mod:`.plane_choice` for the planes): etcd when
``ETCD_ENDPOINTS`` is set or an etcd answers, else the file store; NATS when ``NATS_SERVER`` is set or
a NATS answers, else TCP and ZMQ; the object store follows (files with the file store, else NATS when
connected, else etcd); one start-up line says what was chosen and why. Everything else
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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient

from dynamo.aio import cancel_and_wait

from . import tcp_tls
from .component import Namespace
from .config import EVENT_PLANES, REQUEST_PLANES, RuntimeSettings, check_choice, discovery_backend_name
from .discovery import Discovery
from .discovery_choice import MismatchCheck, choose_discovery, etcd_answers, live_leases_in
from .errors import DynamoRuntimeError, RuntimeConfigError, RuntimeConnectionError
from .etcd import EtcdClient
from .event_plane import EventPlane
from .file_object_store import FileObjectStore
from .file_store import FileStore, FileStoreError, default_file_kv_dir
from .fleet_auth import FleetAuth
from .kv_object_store import DiscoveryObjectStore, FallbackObjectStore
from .kv_store import KeyValueStore
from .lease import LeaseKeeper
from .listeners import Listener, exposure_warning, listeners_line
from .names import lease_hex
from .nats_object_store import NatsObjectStore
from .nats_request_plane import NatsRequestPlane
from .object_store import ObjectStore
from .plane_choice import RECORDS as PLANE_RECORDS
from .plane_choice import PlaneCheck, choose_planes
from .request_plane import RequestPlane
from .response_streams import ResponseStreams
from .tcp import ANY_ADDRESS, LOOPBACK, ListenHosts, listen_hosts
from .tcp_request_plane import TcpRequestPlane

if TYPE_CHECKING:
    from .system_server import SystemStatusServer

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
        self.file_store: FileStore | None = None
        self.discovery_backend = ""  # "etcd" or "file" once connected ("" when static)
        self._mismatch_task: asyncio.Task | None = None
        self._plane_check: PlaneCheck | None = None
        self._discovery_line = "no discovery (static)"  # what was chosen and why, for the start-up line
        # the discovery store, whatever backs it (named etcd for the original's ``runtime.etcd``)
        self.etcd: KeyValueStore | None = None
        self.nats: NatsClient = None  # type: ignore[assignment]  # stays None without NATS
        self.primary_lease_id = 0
        self._lease: LeaseKeeper | None = None
        self._shutdown = asyncio.Event()
        self._closed = False
        self._requests: RequestPlane | None = None
        self._events: EventPlane | None = None  # None when static: events are found through discovery
        self.request_plane_kind = ""  # where this process serves its endpoints: "tcp" or "nats", once connected
        self._object_stores: dict[str, ObjectStore] = {}
        self._streams: ResponseStreams | None = None
        self._shutdown_task: asyncio.Task | None = None
        # the worker's status server (DYN_SYSTEM_ENABLED / DYN_SYSTEM_PORT), None when off
        self.system: "SystemStatusServer | None" = None
        # where the internal listeners bind and what they advertise (chosen with the discovery backend)
        self.listen_hosts: ListenHosts | None = None
        # the fleet secret's keys (DYN_FLEET_SECRET), for listeners outside the runtime (the KV transfer
        # server); None without a secret
        self.fleet_auth: FleetAuth | None = None

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
                self.etcd = KeyValueStore(await self._open_discovery(), lambda: self.primary_lease_id,
                                          self._shutdown.is_set)
            settings = self.settings
            # loopback on one machine (file discovery) unless DYN_TCP_RPC_HOST opens the planes
            hosts = self.listen_hosts = listen_hosts(settings.tcp_host, one_machine=self.discovery_backend == "file")
            auth = self.fleet_auth = FleetAuth(settings.fleet_secret) if settings.fleet_secret else None
            planes = await choose_planes(settings, self.is_static)  # the request and event planes
            self.request_plane_kind = planes.requests
            self.nats = planes.nats  # type: ignore[assignment]  # None: no NATS (TCP and ZMQ planes)
            # either way a client reaches the workers of both planes (by their instance records' address)
            self._requests = TcpRequestPlane(hosts.bind, settings.tcp_rpc_port,
                                             fallback=NatsRequestPlane(self.nats) if self.nats is not None else None,
                                             serve_on_fallback=planes.requests == "nats", advertise=hosts.advertise,
                                             auth=auth)
            self._streams = ResponseStreams(settings, self.nats, hosts, auth)
            listeners = []
            if planes.requests == "tcp":
                listeners.append(Listener("requests", hosts.bind, settings.tcp_rpc_port))
            if settings.response_transport != "nats":
                listeners.append(Listener("response streams", hosts.callhome))
            if self.etcd is not None:
                self._lease = LeaseKeeper(self.etcd.client, settings.lease_ttl, on_restored=self.etcd.republish)
                self.primary_lease_id = await self._lease.start()
            if self.etcd is not None:  # binds nothing until something publishes
                from .event_channels import EventChannels  # pyzmq: imported only by processes that use it

                self._events = EventChannels(self.etcd, planes.events, nats=self.nats, host=hosts.bind,
                                             advertise=hosts.advertise, auth=auth)
                if planes.events == "zmq":  # one port per publisher, each said as it binds
                    listeners.append(Listener("events", hosts.bind))
            if self.settings.system.enabled:
                from .system_server import SystemStatusServer  # aiohttp.web, prometheus_client: only when on

                # DYN_SYSTEM_HOST, else loopback when the planes are on it, else every interface (as before,
                # for a scraper on another machine)
                system_host = settings.system.host or (LOOPBACK if hosts.loopback else ANY_ADDRESS)
                self.system = SystemStatusServer(replace(settings.system, host=system_host))
                await self.system.start()
                listeners.append(Listener("status", self.system.host, self.system.port or 0))
            tls = tcp_tls.settings()
            log.info("%s, request plane %s, event plane %s (%s), object store %s%s", self._discovery_line,
                     planes.requests, planes.events, planes.why, self._object_store_kind(),
                     listeners_line(listeners, hosts, authenticated=auth is not None, tls=tls.describe()))
            warning = exposure_warning(listeners, authenticated=auth is not None, mutual_tls=tls.mutual)
            if warning:
                log.warning("%s", warning)
            if self.etcd is not None:
                self._start_mismatch_check()
                self._plane_check = PlaneCheck(self.etcd, self.primary_lease_id, planes)
                await self._plane_check.start()
        except BaseException:
            await self._close_connections()
            raise

    # ------------------------------------------------------------------ discovery backend (chosen here only)

    async def _open_discovery(self) -> Discovery:
        """etcd or the file store: as asked, else by the rule of :mod:`.discovery_choice`; one log line."""
        backend, why = await choose_discovery(self.settings)
        self.discovery_backend = backend
        if backend == "file":
            self.file_store = FileStore(self.settings.file_kv)  # None: DYN_FILE_KV, else the default
            try:
                await self.file_store.connect()
            except FileStoreError as exc:
                raise RuntimeConfigError(str(exc)) from None
            self._discovery_line = f"discovery file ({self.file_store.root}; {why})"
            return self.file_store
        self.etcd_client = EtcdClient(self.settings.etcd)
        await self.etcd_client.connect()
        self._discovery_line = f"discovery etcd ({self.etcd_client.endpoint}; {why})"
        return self.etcd_client

    def _start_mismatch_check(self) -> None:
        """Say so when this process is alone in its store while the other backend is in use."""
        store = self.etcd
        if store is None:
            return
        me = self.primary_lease_id

        async def others_here() -> bool:  # every process says its planes there (runtime/plane_choice.py)
            return any(kv.lease not in (0, me) for kv in await store.get_prefix(PLANE_RECORDS))

        async def other_in_use() -> str | None:
            if self.discovery_backend == "file":
                endpoint = self.settings.etcd.endpoints[0]
                return f"an etcd answers at {endpoint}" if await etcd_answers(endpoint) else None
            root = default_file_kv_dir() if self.settings.file_kv is None else self.settings.file_kv
            live = await asyncio.to_thread(live_leases_in, Path(root))
            return f"{live} process(es) use the file store at {root}" if live else None

        check = MismatchCheck(self.discovery_backend, others_here, other_in_use)
        self._mismatch_task = asyncio.get_running_loop().create_task(check.run(), name="discovery-mismatch")

    # ------------------------------------------------------------------ identity

    @property
    def instance_id(self) -> int:
        return self.primary_lease_id

    @property
    def instance_hex(self) -> str:
        return lease_hex(self.primary_lease_id)

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, name)

    async def machine_auth(self) -> FleetAuth | None:
        """Keys this user's processes on this machine share and no one else holds: derived from the file
        store's own secret when the store is this user's alone (None: etcd, a ``DYN_FILE_KV`` directory
        another user owns or may read, or a store whose secret cannot be kept; that last one in a line)."""
        store = self.file_store
        if store is None or not store.private:
            return None
        try:
            return FleetAuth(await store.local_secret())
        except (OSError, FileStoreError) as exc:
            log.warning("file store %s: no secret of its own (%s)", store.root, exc)
            return None

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

    def event_plane(self) -> EventPlane | None:
        """Publishing and following events (KV events, load, routers' bookings) in Dynamo 1.x's form
        (:mod:`.event_plane`); None in a static runtime (no discovery to find publishers in)."""
        if self._requests is None:
            raise _not_connected()
        return self._events

    def object_store(self, bucket: str) -> ObjectStore:
        """Named blobs shared by the namespace's processes (a model's tokenizer), in ``bucket``: beside
        the file store when discovery is on files (every process that meets there shares the directory),
        else NATS JetStream when NATS is connected (a read it cannot answer is asked of etcd), else
        chunked into etcd (:mod:`.kv_object_store`), which reaches every machine without NATS."""
        store = self._object_stores.get(bucket)
        if store is not None:
            return store
        # one handle per bucket: it opens (or creates) the bucket once, on first use
        if self.file_store is not None:
            store = FileObjectStore(self.file_store.root, bucket)
        elif self.nats is not None and self.etcd_client is not None:
            store = FallbackObjectStore(NatsObjectStore(self.nats, bucket),
                                        DiscoveryObjectStore(self.etcd_client, bucket))
        elif self.nats is not None:  # static: no etcd
            store = NatsObjectStore(self.nats, bucket)
        elif self.etcd_client is not None:
            store = DiscoveryObjectStore(self.etcd_client, bucket)
        else:
            raise _not_connected()
        self._object_stores[bucket] = store
        return store

    def _object_store_kind(self) -> str:
        if self.file_store is not None:
            return "files"
        return "NATS" if self.nats is not None else "etcd"

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
        await cancel_and_wait(self._mismatch_task)
        if self._plane_check is not None:
            await self._plane_check.close()
        if self.system is not None:
            await self.system.close()
        if self._lease is not None:
            await self._lease.stop()
        if self._streams is not None:
            await self._streams.close()
        if self._requests is not None:
            await self._requests.close()
        if self._events is not None:
            await self._events.close()
        if self.nats is not None and not self.nats.is_closed:
            try:
                await self.nats.close()
            except Exception:  # noqa: BLE001
                pass
        if self.etcd_client is not None:
            await self.etcd_client.close()
        if self.file_store is not None:
            await self.file_store.close()

    async def __aenter__(self) -> "DistributedRuntime":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _not_connected() -> DynamoRuntimeError:
    return DynamoRuntimeError("runtime is not connected: await DistributedRuntime.connect() (or rt.start())")


async def connect_runtime(*, discovery_backend: str | None = None, request_plane: str | None = None,
                          event_plane: str | None = None) -> DistributedRuntime:
    """Connect with the settings in the environment, for a command-line process: a bad setting or an
    unreachable etcd / NATS is a one-line :class:`UserError`, not a traceback. ``discovery_backend``,
    ``request_plane`` and ``event_plane`` (the command line's) win over the environment's."""
    from dynamo.errors import UserError

    try:
        settings = RuntimeSettings.from_env()
        if discovery_backend:
            settings.discovery_backend = discovery_backend_name(discovery_backend)
        settings.request_plane = check_choice("--request-plane", request_plane, REQUEST_PLANES) or settings.request_plane
        settings.event_plane = check_choice("--event-plane", event_plane, EVENT_PLANES) or settings.event_plane
        return await DistributedRuntime.connect(settings)
    except (RuntimeConnectionError, RuntimeConfigError) as e:
        raise UserError(str(e)) from None
