"""What a worker tells the KV routers: its KV events and load on the event plane, in Dynamo 1.x's shapes
(:mod:`dynamo.kv.v1_events`) and envelopes (:mod:`dynamo.runtime.v1_event_wire`), read alike by our
frontends and 1.6.1's, and two endpoints beside ``generate``: ``load_metrics`` (the engine's current
load, for a frontend that has not heard it yet) and the recovery endpoint
(``worker_kv_query_source_<publisher id hex>``, served from ``kv_state_dump``) a router asks for every
block the worker holds when it starts following it, or after a reconnect.  The frontend's side is
:mod:`dynamo.frontend.kv_policy`.  A router follows a worker's events only once it has its ``EventSource``
record and an answer from that endpoint: a 1.6.1 router without either was seen to score no overlap for a
repeated prompt.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator, Callable

import orjson

from dynamo.errors import UserError
from dynamo.kv.hashing import MASK64
from dynamo.kv.v1_events import (
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    V1KvNumbering,
    active_load,
    encode_router_events,
    query_source_endpoint,
    source_metadata,
)
from dynamo.llm.engine import PublishesKvEvents
from dynamo.runtime import Endpoint
from dynamo.runtime.annotated import BareItem
from dynamo.runtime.event_plane import EventPlane, EventPublisher
from dynamo.runtime.v1_event_wire import EndpointScope
from dynamo.runtime.v1_records import endpoint_key

log = logging.getLogger(__name__)

Callback = Callable[[dict[str, Any]], Any]


async def serve_load_metrics(endpoint: Endpoint, engine: PublishesKvEvents) -> asyncio.Task[None]:
    """A ``load_metrics`` endpoint beside ``generate`` answering with the engine's current metrics."""
    comp = endpoint.component
    metrics_ep = comp.endpoint("load_metrics")

    async def handler(request: Any) -> AsyncIterator[dict[str, Any]]:
        for metrics in engine.all_load_metrics():
            yield metrics

    return asyncio.create_task(metrics_ep.serve_endpoint(handler), name="load-metrics")


def check_no_second_form() -> None:
    """``DYN_KV_EVENTS_1X`` chose whether 1.x's form went out beside ours; there is one form now, so a 0
    cannot be honoured (it would mean no KV events at all): one line, not a silent change."""
    raw = os.environ.get("DYN_KV_EVENTS_1X", "").strip().lower()
    if raw in ("0", "false", "off", "no"):
        raise UserError("DYN_KV_EVENTS_1X=0: KV events have one form, Dynamo 1.x's, and cannot be turned off "
                        "apart; unset it (a worker that should publish none: an engine without KV events)")


class KvPublishing:
    """This worker's KV events and load on the event plane (see the module's docstring)."""

    def __init__(self, endpoint: Endpoint, plane: EventPlane, kv_pub: EventPublisher,
                 metrics_pub: EventPublisher) -> None:
        self.endpoint = endpoint
        self.plane = plane
        self.kv_pub = kv_pub
        self.metrics_pub = metrics_pub
        self.numbering = V1KvNumbering(endpoint.lease_id())
        self.recovery: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, endpoint: Endpoint) -> "KvPublishing | None":
        """The publishers of ``endpoint``'s worker (their channel records written); None in a static runtime
        (no discovery: no router can find them)."""
        plane = endpoint.runtime.event_plane()
        if plane is None:
            return None
        ident = endpoint.id
        scope = EndpointScope(ident.namespace, ident.component, ident.name)
        kv_pub = await plane.publisher(scope, TOPIC_KV_EVENTS)
        metrics_pub = await plane.publisher(scope, TOPIC_KV_METRICS)
        return cls(endpoint, plane, kv_pub, metrics_pub)

    def callbacks(self) -> tuple[Callback, Callback]:
        """(publish_kv_event, publish_metrics) for the engine.  The numbering advances in the synchronous
        part of the call, where ``WorkerKvState`` records the event, so a recovery answer and the stream
        agree on what it covers."""
        numbering, kv_pub, metrics_pub = self.numbering, self.kv_pub, self.metrics_pub

        def kv_event(event: dict[str, Any]) -> Any:
            return kv_pub.publish(encode_router_events(numbering.translate(event)))

        def metrics(report: dict[str, Any]) -> Any:
            payload = active_load(report)
            return None if payload is None else metrics_pub.publish(payload)

        return kv_event, metrics

    async def serve_recovery(self, engine: Any) -> None:
        """Serve the recovery endpoint routers (ours and 1.x's) query before following this worker's events,
        and write the ``EventSource`` record that names it.  ``engine``: what answers ``kv_state_dump()`` (None: an
        engine that cannot say what it holds, answered with an empty dump; its live events still count)."""
        ident = self.endpoint.id
        name = query_source_endpoint(self.kv_pub.publisher_id)
        numbering = self.numbering

        async def handler(request: Any) -> AsyncIterator[BareItem]:
            dump = engine.kv_state_dump() if engine is not None else {}
            yield BareItem(numbering.tree_dump(dump))  # 1.x reads the answer as is, not Annotated

        ep = self.endpoint.component.endpoint(name)
        ready = asyncio.Event()
        self.recovery = asyncio.create_task(ep.serve_endpoint(handler, ready=ready), name="kv-recovery")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([self.recovery, waiter], return_when=asyncio.FIRST_COMPLETED)
        if self.recovery.done():
            waiter.cancel()
            self.recovery.result()  # raises why it could not serve
        target = await recovery_target(self.endpoint, name)
        if "transport" not in target:
            log.info("%s is served over NATS, which Dynamo 1.x frontends cannot reach: their KV routers will not "
                     "follow this worker (ours do; serve it on TCP for theirs: DYN_REQUEST_PLANE=tcp)", name)
        metadata = source_metadata(ident.namespace, ident.component, ident.name, self.endpoint.lease_id(),
                                   self.kv_pub.publisher_id, target)
        await self.plane.register_source(self.kv_pub, metadata)
        log.info("KV events on %s (recovery on %s)", self.kv_pub.scope.subject_prefix, name)


async def recovery_target(endpoint: Endpoint, name: str) -> dict[str, Any]:
    """The ``v1/instances`` record of this process's endpoint ``name`` (what an ``EventSource`` record's
    ``recovery_target`` holds: 1.6.1 calls the address in it).  An endpoint served over NATS (its record's
    transport is ``nats_tcp``, which 1.x's router does not call) gives its names alone, without a
    ``transport``, which is all our routers read (they reach it through our own client)."""
    ident = endpoint.id
    kv = await endpoint.runtime.discovery().get(endpoint_key(ident.namespace, ident.component, name,
                                                             endpoint.lease_id()))
    record = orjson.loads(kv.value) if kv is not None else None
    if isinstance(record, dict) and "tcp" in (record.get("transport") or {}):
        return dict(record)
    return {"namespace": ident.namespace, "component": ident.component, "endpoint": name,
            "instance_id": endpoint.lease_id() & MASK64}
