"""Distributed runtime: discovery with leases (etcd), requests and events (NATS), TCP response streams.

Public API (mirrors the original's Python binding where it exists)::

    @dynamo_worker(static=False)
    async def worker(runtime: DistributedRuntime):
        component = runtime.namespace("ns").component("backend")
        await component.create_service()
        endpoint = component.endpoint("generate")
        await endpoint.serve_endpoint(handler)      # async generator handler(request[, context])

    client = await runtime.namespace("ns").component("backend").endpoint("generate").client()
    await client.wait_for_instances()
    async for item in client.round_robin({"x": 1}):
        ...

See docs/runtime.md.
"""

from .annotated import Annotated
from .client import Client, ResponseStream
from .component import Component, Endpoint, Namespace
from .config import EtcdSettings, NatsSettings, RuntimeSettings
from .context import Context
from .discovery import Discovery, DiscoveryWatch, KeyValue, WatchEvent
from .distributed import DistributedRuntime
from .errors import (
    STREAM_INCOMPLETE_MESSAGE,
    AckTimeoutError,
    DynamoRuntimeError,
    EngineError,
    InstanceNotFoundError,
    LeaseLostError,
    NoInstancesError,
    NoRespondersError,
    RuntimeConfigError,
    RuntimeConnectionError,
    ServiceAlreadyExistsError,
    StreamIncompleteError,
    StreamStalledError,
    WorkerBusyError,
    WorkerDrainedError,
)
from .etcd import EtcdClient
from .etcd_watch import PrefixWatch
from .event_plane import EventPlane
from .instance import Instance
from .kv_store import KeyValueStore
from .names import EndpointId, lease_hex, parse_lease_hex, slugify
from .request_plane import RequestPlane
from .worker import dynamo_worker, run_worker

__all__ = [
    "AckTimeoutError", "StreamStalledError", "WorkerBusyError", "WorkerDrainedError",
    "Annotated", "Client", "Component", "Context", "Discovery", "DiscoveryWatch", "DistributedRuntime",
    "DynamoRuntimeError", "EndpointId", "Endpoint", "EngineError", "EtcdClient", "EventPlane", "EtcdSettings", "Instance", "InstanceNotFoundError",
    "KeyValue", "KeyValueStore", "LeaseLostError", "Namespace", "NatsSettings", "NoInstancesError",
    "NoRespondersError", "PrefixWatch", "RequestPlane", "ResponseStream", "RuntimeConfigError", "RuntimeConnectionError", "RuntimeSettings",
    "STREAM_INCOMPLETE_MESSAGE", "ServiceAlreadyExistsError", "StreamIncompleteError", "WatchEvent",
    "dynamo_worker", "lease_hex", "parse_lease_hex", "run_worker", "slugify",
]
