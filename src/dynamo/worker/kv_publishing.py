"""What a worker tells the KV routers: its KV events and load metrics on the event plane, and two
endpoints beside ``generate``: ``load_metrics`` (the engine's current load) and ``kv_state`` (every block
it holds, for a router that starts after the worker).  The frontend's side is
:mod:`dynamo.frontend.kv_policy`; the event shapes are :mod:`dynamo.kv.events`.

**Dynamo 1.x routers too** (:class:`V1KvPublishing`): the same events and load also go out in 1.x's form
(:mod:`dynamo.kv.v1_events`) on 1.x's event plane (:mod:`dynamo.runtime.v1_event_wire`), so that a 1.6.1
frontend with ``--router-mode kv`` sends a repeated prompt to the worker of ours that holds it.  A 1.6.1
router follows a worker's events only once it has its ``EventSource`` record and an answer from its
recovery endpoint (``worker_kv_query_source_<publisher id hex>``, served here from ``kv_state_dump``):
without either, it was seen to score no overlap for a repeated prompt.  ``DYN_KV_EVENTS_1X=0`` turns the
1.x form off (a fleet with no 1.x process saves two sockets and a copy of each event); a fleet secret
does too (1.x's event plane has no authentication: the runtime opens none).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator, Callable

import orjson

from dynamo.kv.events import KV_STATE_ENDPOINT
from dynamo.kv.v1_events import (
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    V1KvNumbering,
    active_load,
    encode_router_events,
    query_source_endpoint,
    source_metadata,
)
from dynamo.llm.engine import DumpsKvState, PublishesKvEvents
from dynamo.runtime import Endpoint
from dynamo.runtime.annotated import BareItem
from dynamo.runtime.names import component_event_subject, namespace_event_subject
from dynamo.runtime.v1_event_wire import EndpointScope
from dynamo.runtime.v1_records import endpoint_key

log = logging.getLogger(__name__)

Callback = Callable[[dict[str, Any]], Any]


def worker_event_publishers(endpoint: Endpoint) -> tuple[Callback, Callback]:
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


def kv_events_1x_enabled() -> bool:
    """``DYN_KV_EVENTS_1X`` (default on): also publish KV events and load in Dynamo 1.x's form."""
    raw = os.environ.get("DYN_KV_EVENTS_1X", "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw not in ("0", "false", "off", "no"):
        log.warning("DYN_KV_EVENTS_1X=%r is not a boolean; publishing 1.x events", raw)
        return True
    return False


class V1KvPublishing:
    """This worker's KV events and load, also in Dynamo 1.x's form (see the module's docstring)."""

    def __init__(self, endpoint: Endpoint, plane: Any, kv_pub: Any, metrics_pub: Any) -> None:
        self.endpoint = endpoint
        self.plane = plane
        self.kv_pub = kv_pub
        self.metrics_pub = metrics_pub
        self.numbering = V1KvNumbering(endpoint.lease_id())
        self.recovery: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, endpoint: Endpoint) -> "V1KvPublishing | None":
        """The 1.x publishers of ``endpoint``'s worker (their channel records written), or None when the
        1.x form is off (``DYN_KV_EVENTS_1X=0``, a fleet secret, a static runtime)."""
        if not kv_events_1x_enabled():
            return None
        plane = endpoint.runtime.v1_event_plane()
        if plane is None:
            return None
        ident = endpoint.id
        scope = EndpointScope(ident.namespace, ident.component, ident.name)
        kv_pub = await plane.publisher(scope, TOPIC_KV_EVENTS)
        metrics_pub = await plane.publisher(scope, TOPIC_KV_METRICS)
        return cls(endpoint, plane, kv_pub, metrics_pub)

    def wrap(self, publish_kv_event: Callback, publish_metrics: Callback) -> tuple[Callback, Callback]:
        """Callbacks that publish on our plane as before and in 1.x's form as well.  The 1.x numbering
        advances in the synchronous part of the call, where ``WorkerKvState`` numbers its own events, so
        a recovery answer and the stream agree on what it covers."""
        numbering, kv_pub, metrics_pub = self.numbering, self.kv_pub, self.metrics_pub

        def kv_event(event: dict[str, Any]) -> Any:
            ours = publish_kv_event(event)
            theirs = kv_pub.publish(encode_router_events([numbering.translate(event)]))
            return _both(ours, theirs)

        def metrics(report: dict[str, Any]) -> Any:
            ours = publish_metrics(report)
            payload = active_load(report)
            return ours if payload is None else _both(ours, metrics_pub.publish(payload))

        return kv_event, metrics

    async def serve_recovery(self, engine: Any) -> None:
        """Serve the recovery endpoint 1.x routers query before following this worker's events, and write
        the ``EventSource`` record that names it.  ``engine``: what answers ``kv_state_dump()`` (None: an
        engine that cannot say what it holds, answered with an empty dump; its live events still count)."""
        ident = self.endpoint.id
        name = query_source_endpoint(self.kv_pub.publisher_id)
        numbering = self.numbering

        async def handler(request: Any) -> AsyncIterator[BareItem]:
            dump = engine.kv_state_dump() if engine is not None else {}
            yield BareItem(numbering.tree_dump(dump))  # 1.x reads the answer as is, not Annotated

        ep = self.endpoint.component.endpoint(name)
        ready = asyncio.Event()
        self.recovery = asyncio.create_task(ep.serve_endpoint(handler, ready=ready), name="kv-recovery-1x")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([self.recovery, waiter], return_when=asyncio.FIRST_COMPLETED)
        if self.recovery.done():
            waiter.cancel()
            self.recovery.result()  # raises why it could not serve
        target = await recovery_target(self.endpoint, name)
        if target is None:
            log.info("KV events in Dynamo 1.x's form are published, but %s is served over NATS, which 1.x "
                     "frontends cannot reach: their KV routers will not follow this worker (serve it on TCP: "
                     "DYN_REQUEST_PLANE=tcp)", name)
            return
        metadata = source_metadata(ident.namespace, ident.component, ident.name, self.endpoint.lease_id(),
                                   self.kv_pub.publisher_id, target)
        await self.plane.register_source(self.kv_pub, metadata)
        log.info("KV events also in Dynamo 1.x's form: %s (recovery on %s)", self.kv_pub.scope.subject_prefix, name)


async def recovery_target(endpoint: Endpoint, name: str) -> dict[str, Any] | None:
    """The ``v1/instances`` record of this process's endpoint ``name`` (what an ``EventSource`` record's
    ``recovery_target`` holds: 1.6.1 calls the address in it); None when there is none: an endpoint served
    over NATS (its record's transport is ``nats_tcp``), which 1.x does not call."""
    ident = endpoint.id
    kv = await endpoint.runtime.discovery().get(endpoint_key(ident.namespace, ident.component, name,
                                                             endpoint.lease_id()))
    record = orjson.loads(kv.value) if kv is not None else None
    return record if isinstance(record, dict) and "tcp" in (record.get("transport") or {}) else None


def _both(first: Any, second: Any) -> Any:
    """One awaitable for two publishes (either may be None: nothing to wait for)."""
    waits = [w for w in (first, second) if w is not None]
    if len(waits) < 2:
        return waits[0] if waits else None
    return asyncio.gather(*waits)
