"""The request plane over NATS (the first :class:`~dynamo.runtime.request_plane.RequestPlane`).

A component is a NATS micro service (version 0.0.1, one group named after the service); each served
endpoint is a service endpoint in that group, so its address is the subject ``<service>.<endpoint>``
and ``$SRV.STATS`` answers carry the component's stats handler (load metrics). A request is published
with a reply subject under one wildcard inbox (:mod:`.ack`); the ack comes back there. nats-py's
exceptions are turned into the plane's own here, so nothing above this module knows NATS.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import nats.errors
from nats import micro
from nats.aio.client import Client as NatsClient

from .ack import RequestSender
from .errors import DynamoRuntimeError, ServiceAlreadyExistsError
from .nats_conn import subscriptions_live
from .request_plane import NoResponders, RequestHandler, RequestPlaneError
from .transport import StreamState

log = logging.getLogger(__name__)

SERVICE_VERSION = "0.0.1"
RECONNECT_POLL = 0.05  # nats-py has no event for "reconnected": poll this often


class NatsEndpoint:
    """One served endpoint of a micro service."""

    def __init__(self, service: micro.Service, endpoint: Any, address: str) -> None:
        self.service = service
        self.endpoint = endpoint
        self.address = address

    async def stop(self) -> None:
        """Unsubscribe this endpoint alone (nats-py has no public call for a single one)."""
        service, endpoint = self.service, self.endpoint
        try:
            if endpoint in service._endpoints:
                service._endpoints.remove(endpoint)
            if getattr(endpoint, "_subscription", None) is not None:
                await endpoint._stop()
        except Exception as exc:  # noqa: BLE001 - NATS may already be closed
            log.debug("stopping NATS endpoint failed: %s", exc)


class NatsRequestPlane:
    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self._sender: RequestSender | None = None
        self._services: dict[str, micro.Service] = {}

    # ------------------------------------------------------------------ client side

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def wait_connected(self, timeout: float) -> bool:
        nc = self.nc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if nc.is_connected:
                return True
            if nc.is_closed:
                return False
            await asyncio.sleep(RECONNECT_POLL)
        return bool(nc.is_connected)

    async def send(self, address: str, payload: bytes, timeout: float, state: StreamState | None = None) -> bytes:
        try:
            if state is None:  # nothing to race the ack against (a ping)
                msg = await self.nc.request(address, payload, timeout=timeout)
                return bytes(msg.data)
            if self._sender is None:
                self._sender = RequestSender(self.nc)
            return await self._sender.send(address, payload, timeout, state)
        except nats.errors.NoRespondersError:
            raise NoResponders(address) from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"no acknowledgement from {address} within {timeout:g}s") from None
        except nats.errors.Error as exc:  # connection closed / reconnecting: nothing reached a worker
            raise RequestPlaneError(f"cannot send the request over NATS: {exc or type(exc).__name__}") from None

    # ------------------------------------------------------------------ worker side

    async def add_service(self, name: str, *, description: str = "",
                          stats_handler: Callable[[Any], Any] | None = None) -> None:
        if name in self._services:
            raise ServiceAlreadyExistsError("Service already exists")
        self._services[name] = await micro.add_service(
            self.nc, name=name, version=SERVICE_VERSION, description=description, stats_handler=stats_handler)

    def set_stats_handler(self, name: str, stats_handler: Callable[[Any], Any]) -> None:
        service = self._services.get(name)
        if service is None:
            raise DynamoRuntimeError("create_service() first")
        service._stats_handler = stats_handler

    async def serve(self, service: str, endpoint: str, handler: RequestHandler, path: str = "") -> NatsEndpoint:
        """(``path``, an endpoint's name on a TCP port, has no use on NATS: its subject names it.)"""
        svc = self._services.get(service)
        if svc is None:
            await self.add_service(service)
            svc = self._services[service]
        group = svc.add_group(name=service)
        await group.add_endpoint(name=endpoint, handler=handler)
        served = next(e for e in reversed(svc._endpoints) if e._name == endpoint)
        await subscriptions_live(self.nc)  # the subscription is live on the server before anyone is told
        return NatsEndpoint(svc, served, f"{service}.{endpoint}")

    async def close(self) -> None:
        for service in list(self._services.values()):
            try:
                await service.stop()
            except Exception:  # noqa: BLE001
                pass
        self._services.clear()
