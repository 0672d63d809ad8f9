"""What a worker tells the KV routers: its KV events and load metrics on the event plane, and two
endpoints beside ``generate``: ``load_metrics`` (the engine's current load) and ``kv_state`` (every block
it holds, for a router that starts after the worker).  The frontend's side is
:mod:`dynamo.frontend.kv_policy`; the event shapes are :mod:`dynamo.kv.events`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import orjson

from dynamo.kv.events import KV_STATE_ENDPOINT
from dynamo.llm.engine import DumpsKvState, PublishesKvEvents
from dynamo.runtime import Endpoint
from dynamo.runtime.names import component_event_subject, namespace_event_subject


def worker_event_publishers(endpoint: Endpoint) -> tuple[Callable[[dict[str, Any]], Any], Callable[[dict[str, Any]], Any]]:
    """(publish_kv_event, publish_metrics) callbacks for an engine serving on ``endpoint``."""
    events = endpoint.runtime.event_plane()
    ident = endpoint.id
    kv_subject = component_event_subject(ident.namespace, ident.component, "kv_events")
    metrics_subject = namespace_event_subject(ident.namespace, "kv_metrics")

    def publish_kv_event(event: dict[str, Any]) -> Any:
        return events.publish(kv_subject, orjson.dumps(event))

    def publish_metrics(metrics: dict[str, Any]) -> Any:
        return events.publish(metrics_subject, orjson.dumps(metrics))

    return publish_kv_event, publish_metrics


async def serve_load_metrics(endpoint: Endpoint, engine: PublishesKvEvents) -> asyncio.Task[None]:
    """A ``load_metrics`` endpoint beside ``generate`` answering with the engine's current metrics."""
    comp = endpoint.component
    metrics_ep = comp.endpoint("load_metrics")

    async def handler(request: Any) -> AsyncIterator[dict[str, Any]]:
        for metrics in engine.all_load_metrics():
            yield metrics

    return asyncio.create_task(metrics_ep.serve_endpoint(handler), name="load-metrics")


async def serve_kv_state(endpoint: Endpoint, engine: DumpsKvState) -> asyncio.Task[None]:
    """A ``kv_state`` endpoint answering with every block the engine caches (``engine.kv_state_dump()``),
    for routers that start after the worker."""
    ep = endpoint.component.endpoint(KV_STATE_ENDPOINT)

    async def handler(request: Any) -> AsyncIterator[dict[str, Any]]:
        yield engine.kv_state_dump()

    return asyncio.create_task(ep.serve_endpoint(handler), name="kv-state")
