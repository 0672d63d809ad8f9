"""Namespace / Component / Endpoint: the handles user code navigates (``runtime.namespace(ns)
.component(c).endpoint(e)``), and serving an endpoint.

A component is a service of the request plane (name ``slug(ns_comp)``); each served endpoint is served
there as ``<ep>-<lease_hex>``, so over NATS its request subject is ``<service>.<ep>-<lease_hex>``.
Serving also writes the endpoint's one discovery record under the primary lease: Dynamo 1.x's
``v1/instances`` Endpoint (instance.py), so that clients of ours and 1.x's alike find it.

The handles hold a :class:`RuntimeHandle`: the runtime's parts they use (settings, lease, planes,
discovery), not the runtime's class, so this module does not depend on the module that builds a runtime.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .client import Client
from .config import RuntimeSettings
from .errors import DynamoRuntimeError, ServiceAlreadyExistsError
from .event_plane import EventPlane
from .ingress import Handler, Ingress
from .instance import Instance
from .kv_store import KeyValueStore
from .names import EndpointId, component_event_subject, component_service_name, lease_hex, namespace_event_subject
from .request_plane import RequestPlane
from .response_streams import ResponseStreams
from .v1_wire import v1_path

if TYPE_CHECKING:
    from .system_server import SystemStatusServer

log = logging.getLogger(__name__)


class RuntimeHandle(Protocol):
    """What the handles use of the runtime that made them (a DistributedRuntime is one)."""

    settings: RuntimeSettings
    is_static: bool
    primary_lease_id: int
    system: "SystemStatusServer | None"
    request_plane_kind: str  # "tcp" or "nats": where this process serves its endpoints

    def discovery(self) -> KeyValueStore: ...

    def request_plane(self) -> RequestPlane: ...

    def event_plane(self) -> EventPlane | None:
        """None in a static runtime."""

    def response_streams(self) -> ResponseStreams: ...

    async def wait_for_shutdown(self) -> None: ...


class Namespace:
    def __init__(self, runtime: RuntimeHandle, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> "Component":
        return Component(self, name)

    def event_subject(self, event: str) -> str:
        """``namespace.<ns>.<event>`` (e.g. ``kv-hit-rate``)."""
        return namespace_event_subject(self.name, event)

    def __repr__(self) -> str:
        return f"Namespace({self.name!r})"


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self.runtime = namespace.runtime

    @property
    def service_name(self) -> str:
        return component_service_name(self.namespace.name, self.name)

    def endpoint(self, name: str) -> "Endpoint":
        return Endpoint(self, name)

    def event_subject(self, event: str) -> str:
        """``namespace.<ns>.component.<comp>.<event>`` (e.g. ``kv_events``)."""
        return component_event_subject(self.namespace.name, self.name, event)

    async def create_service(self, stats_handler: Callable[[Any], Any] | None = None) -> None:
        """Register this component's service (a NATS micro service). Fails if this process already did."""
        await self.runtime.request_plane().add_service(
            self.service_name, description=f"Dynamo component {self.name} in namespace {self.namespace.name}",
            stats_handler=stats_handler)

    def set_stats_handler(self, stats_handler: Callable[[Any], Any]) -> None:
        """User data for ``$SRV.STATS`` answers (how load metrics are exposed). Needs create_service."""
        self.runtime.request_plane().set_stats_handler(self.service_name, stats_handler)

    async def _ensure_service(self) -> None:
        try:
            await self.create_service()
        except ServiceAlreadyExistsError:
            pass

    def __repr__(self) -> str:
        return f"Component({self.namespace.name!r}, {self.name!r})"


class Endpoint:
    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self.name = name
        self.runtime = component.runtime
        self.id = EndpointId(component.namespace.name, component.name, name)

    def lease_id(self) -> int:
        """This process's instance id (its primary lease id); 0 for static runtimes."""
        return self.runtime.primary_lease_id

    @property
    def subject(self) -> str:
        return self.id.subject(self.lease_id())

    @property
    def instance_key(self) -> str:
        return self.id.instance_key(self.lease_id())

    async def serve_endpoint(self, handler: Handler, graceful_shutdown: bool = True,
                             *, ready: asyncio.Event | None = None, max_inflight: int | None = None,
                             drain_timeout: float | None = None) -> None:
        """Serve ``handler`` on this endpoint until the runtime shuts down.

        Order on shutdown: stop taking requests and remove the instance key (deregister), then let
        in-flight requests finish (up to ``drain_timeout`` seconds, by default
        DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT; at once when ``graceful_shutdown`` is false); the ones still
        running then end with a ``drained`` item, so their clients resume them on other instances. ``ready`` is set once requests can arrive. With
        ``max_inflight``, a request beyond that many in flight is refused as busy (the client then tries
        another instance or queues it).
        """
        runtime = self.runtime
        lease = self.lease_id()
        await self.component._ensure_service()
        system = runtime.system
        metrics = None
        if system is not None:
            metrics = system.endpoint_metrics(self.id.namespace, self.id.component, self.id.name, lease_hex(lease))
            system.set_endpoint(self.name, False)
        ingress = Ingress(handler, name=str(self.id), sink_openers=runtime.response_streams().sink_openers(),
                          max_inflight=max_inflight, metrics=metrics)
        path = v1_path(lease, self.id.namespace, self.id.component, self.id.name)
        served = await runtime.request_plane().serve(self.component.service_name, self.id.endpoint_name(lease),
                                                     ingress.on_request, path)  # live before anyone is told
        store = None if runtime.is_static else runtime.discovery()
        key = None
        try:
            if store is not None:
                key = self.id.instance_key(lease)
                created = await store.create(key, Instance.for_endpoint(self.id, lease, served.address).to_json(), lease=True)
                if not created:
                    raise DynamoRuntimeError(f"Failed to register discoverable service: {key} already exists")
            log.info("serving %s at %s", self.id, served.address)
            if system is not None:
                system.set_endpoint(self.name, True)
            if ready is not None:
                ready.set()
            await runtime.wait_for_shutdown()
        finally:
            ingress.accepting = False
            if system is not None:
                system.set_endpoint(self.name, False)
            await served.stop()
            if key is not None and store is not None:
                try:
                    await store.delete(key)
                except Exception as exc:  # noqa: BLE001 - the lease revocation removes it anyway
                    log.debug("deleting %s failed: %s", key, exc)
            if drain_timeout is None:
                drain_timeout = runtime.settings.graceful_shutdown_timeout
            timeout = drain_timeout if graceful_shutdown else 0
            await ingress.drain(timeout)

    async def client(self, *, static: bool | None = None) -> Client:
        """A client for this endpoint, following its instances in discovery (static: fixed subject)."""
        runtime = self.runtime
        static = runtime.is_static if static is None else static
        client = Client(self.id, settings=runtime.settings, requests=runtime.request_plane(),
                        streams=runtime.response_streams(), discovery=None if static else runtime.discovery().client,
                        static=static)
        return await client._start()

    def __repr__(self) -> str:
        return f"Endpoint({self.id})"

