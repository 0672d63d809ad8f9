"""The client ``depends(Other)`` gives: ``async for x in self.other.generate(req)`` streams ``Other``'s endpoint.

Each endpoint's runtime :class:`~dynamo.runtime.Client` is made on first use (the runtime is the one of
the calling process, from ``dynamo_context``) and kept; requests go round-robin over ``Other``'s live
replicas, as a graph's default routing.  A request whose stream fails *before its first item* (the
replica just died, is draining, or is not acknowledging) is sent again to another replica, up to a few
times: a replica killed while the graph serves is then invisible to callers once its instance is marked
down.  A failure after items have been yielded is raised: resending would repeat them.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

from dynamo.runtime import Client, NoInstancesError, NoRespondersError, StreamIncompleteError, WorkerBusyError

from .context import dynamo_context


class Target(Protocol):
    """What a client needs of the service it calls (service.py's ServiceSpec, which builds these clients:
    a protocol here keeps the import one way)."""

    name: str
    namespace: str

    def endpoints(self) -> Iterable[str]: ...

ATTEMPTS = 4
WAIT_FOR_INSTANCES_S = 60.0


def to_wire(request: Any) -> Any:
    """A pydantic model travels as its JSON-able dict; anything else as it is."""
    dump = getattr(request, "model_dump", None)
    if callable(dump) and not isinstance(request, type):
        return dump(mode="json")
    return request


class ServiceClient:
    """Attribute access gives a streaming call per endpoint of the target service."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._endpoints = set(target.endpoints())
        self._clients: dict[str, Client] = {}
        self._lock = asyncio.Lock()

    def __getattr__(self, name: str) -> Callable[[Any], AsyncIterator[Any]]:
        if name.startswith("_") or name not in self._endpoints:
            raise AttributeError(f"service {self._target.name} has no endpoint {name!r} "
                                 f"(endpoints: {', '.join(sorted(self._endpoints)) or 'none'})")

        def call(request: Any) -> AsyncIterator[Any]:
            return self._stream(name, request)

        return call

    async def _client(self, name: str) -> Client:
        async with self._lock:
            client = self._clients.get(name)
            if client is None:
                runtime = dynamo_context.get("runtime")
                if runtime is None:
                    raise RuntimeError("a depends() client works inside a service started by `dynamo serve`")
                ep = runtime.namespace(self._target.namespace).component(self._target.name).endpoint(name)
                client = await ep.client()
                self._clients[name] = client
        await client.wait_for_instances(timeout=WAIT_FOR_INSTANCES_S)
        return client

    async def _stream(self, name: str, request: Any) -> AsyncIterator[Any]:
        client = await self._client(name)
        payload = to_wire(request)
        for attempt in range(ATTEMPTS):
            started = False
            try:
                async for item in client.round_robin(payload):
                    started = True
                    yield item
                return
            except (NoRespondersError, WorkerBusyError, StreamIncompleteError, NoInstancesError):
                if started or attempt == ATTEMPTS - 1:
                    raise
                if not client.instance_ids():
                    await client.wait_for_instances(timeout=WAIT_FOR_INSTANCES_S)
