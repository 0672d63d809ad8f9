"""Namespace / Component / Endpoint: the handles user code navigates (``runtime.namespace(ns)
.component(c).endpoint(e)``), and serving an endpoint.

A component is a NATS micro service (name ``slug(ns_comp)``, version 0.0.1, one group named after the
service); each served endpoint is a service endpoint ``<ep>-<lease_hex>`` in that group, so its request
subject is ``<service>.<ep>-<lease_hex>`` (spec 7.3). Serving also writes the Instance record under the
primary lease so clients find it (spec 7.2).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

from nats import micro

from .client import Client
from .errors import DynamoRuntimeError, ServiceAlreadyExistsError
from .ingress import Handler, Ingress
from .instance import Instance
from .names import EndpointId, component_event_subject, component_service_name, namespace_event_subject

if TYPE_CHECKING:
    from .distributed import DistributedRuntime

log = logging.getLogger(__name__)

SERVICE_VERSION = "0.0.1"


class Namespace:
    def __init__(self, runtime: "DistributedRuntime", name: str) -> None:
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
        """Register this component's NATS micro service. Fails if this process already did."""
        services = self.runtime._services
        if self.service_name in services:
            raise ServiceAlreadyExistsError("Service already exists")
        services[self.service_name] = await micro.add_service(
            self.runtime.nats,
            name=self.service_name,
            version=SERVICE_VERSION,
            description=f"Dynamo component {self.name} in namespace {self.namespace.name}",
            stats_handler=stats_handler,
        )

    def set_stats_handler(self, stats_handler: Callable[[Any], Any]) -> None:
        """User data for ``$SRV.STATS`` answers (how load metrics are exposed). Needs create_service."""
        service = self.runtime._services.get(self.service_name)
        if service is None:
            raise DynamoRuntimeError("create_service() first")
        service._stats_handler = stats_handler

    async def _service(self) -> micro.Service:
        service = self.runtime._services.get(self.service_name)
        if service is None:
            await self.create_service()
            service = self.runtime._services[self.service_name]
        return service

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
                             *, ready: asyncio.Event | None = None, max_inflight: int | None = None) -> None:
        """Serve ``handler`` on this endpoint until the runtime shuts down.

        Order on shutdown: stop taking requests and remove the instance key (deregister), then let
        in-flight requests finish (up to DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT, or cancel them at once
        when ``graceful_shutdown`` is false). ``ready`` is set once requests can arrive. With
        ``max_inflight``, a request beyond that many in flight is refused as busy (the client then tries
        another instance or queues it).
        """
        runtime = self.runtime
        lease = self.lease_id()
        service = await self.component._service()
        system = runtime.system
        metrics = None
        if system is not None:
            metrics = system.endpoint_metrics(self.id.namespace, self.id.component, self.id.name)
            system.set_endpoint(self.name, False)
        ingress = Ingress(handler, name=str(self.id), sink_openers=runtime._sink_openers(),
                          max_inflight=max_inflight, metrics=metrics)
        group = service.add_group(name=self.component.service_name)
        endpoint_name = self.id.endpoint_name(lease)
        await group.add_endpoint(name=endpoint_name, handler=ingress.on_request)
        nats_endpoint = next(e for e in reversed(service._endpoints) if e._name == endpoint_name)
        await runtime.nats.flush()  # the subscription is live on the server before anyone is told
        key = None
        try:
            if not runtime.is_static:
                assert runtime.etcd is not None  # a non-static runtime has etcd
                key = self.id.instance_key(lease)
                created = await runtime.etcd.create(key, Instance.for_endpoint(self.id, lease).to_json(), lease=True)
                if not created:
                    raise DynamoRuntimeError(f"Failed to register discoverable service: {key} already exists")
            log.info("serving %s on subject %s", self.id, self.id.subject(lease))
            if system is not None:
                system.set_endpoint(self.name, True)
            if ready is not None:
                ready.set()
            await runtime.wait_for_shutdown()
        finally:
            ingress.accepting = False
            if system is not None:
                system.set_endpoint(self.name, False)
            await _stop_nats_endpoint(service, nats_endpoint)
            if key is not None and runtime.etcd is not None:
                try:
                    await runtime.etcd.delete(key)
                except Exception as exc:  # noqa: BLE001 - the lease revocation removes it anyway
                    log.debug("deleting %s failed: %s", key, exc)
            timeout = runtime.settings.graceful_shutdown_timeout if graceful_shutdown else 0
            await ingress.drain(timeout)

    async def client(self, *, static: bool | None = None) -> Client:
        """A client for this endpoint, following its instances through etcd (static: fixed subject)."""
        static = self.runtime.is_static if static is None else static
        return await Client(self.runtime, self.id, static=static)._start()

    def __repr__(self) -> str:
        return f"Endpoint({self.id})"


async def _stop_nats_endpoint(service: micro.Service, endpoint: Any) -> None:
    """Unsubscribe one endpoint of a micro service (nats-py has no public call for a single one)."""
    try:
        if endpoint in service._endpoints:
            service._endpoints.remove(endpoint)
        if getattr(endpoint, "_subscription", None) is not None:
            await endpoint._stop()
    except Exception as exc:  # noqa: BLE001 - NATS may already be closed
        log.debug("stopping NATS endpoint failed: %s", exc)
