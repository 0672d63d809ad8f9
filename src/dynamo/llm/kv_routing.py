"""``--router-mode kv`` on the frontend: a :class:`KvRouter` per model fed over NATS.

Workers publish KV events (blocks stored/removed) on ``namespace.<ns>.component.<comp>.kv_events``; the
router keeps its radix tree from them (or, with ``--use-kv-events false``, predicts the cache from its
own decisions).  Every decision is published on ``namespace.<ns>.kv-hit-rate``.  Frontends share their
in-flight bookkeeping on ``...component.<comp>.active_sequences_events`` so several frontends in front
of the same workers see each other's load and do not pile onto one worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from dynamo.llm.kv_router import KvRouter
from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.runtime.names import component_event_subject, namespace_event_subject

log = logging.getLogger(__name__)


class KvRouterPolicy:
    def __init__(self, router: KvRouter, nats: Any):
        self.router = router
        self._nats = nats
        self._subs: list[Any] = []
        self._tracked: set[str] = set()

    def open(self, client: Any, request: PreprocessedRequest, rt_ctx: Any) -> Any:
        body_id = rt_ctx.id()
        if request.backend_instance_id is not None:
            self.router.add_request(body_id, request.token_ids, request.backend_instance_id)
            self._tracked.add(body_id)
            return client.direct(request.to_dict(), request.backend_instance_id, context=rt_ctx)
        if body_id in self._tracked:  # a migration retry: forget the previous choice first
            self.router.on_finished(body_id)
        # workers at their limit of requests in flight are left out (all of them only in a race)
        candidates = client.free_instance_ids() or client.instance_ids()
        decision = self.router.select(request.token_ids, candidates, request_id=body_id)
        self._tracked.add(body_id)
        request.estimated_prefix_hit_num_blocks = decision.overlap_blocks
        log.debug("request %s -> worker %x (%d cached blocks)", body_id, decision.worker_id, decision.overlap_blocks)
        return client.direct(request.to_dict(), decision.worker_id, context=rt_ctx)

    def first_token(self, request_id: str) -> None:
        self.router.on_first_token(request_id)

    def finished(self, request_id: str) -> None:
        self._tracked.discard(request_id)
        self.router.on_finished(request_id)

    def remove_worker(self, worker_id: int) -> None:
        self.router.remove_worker(worker_id)

    async def subscribe(self, subject: str, handler: Any) -> None:
        async def cb(msg: Any) -> None:
            handler(msg.data)

        self._subs.append(await self._nats.subscribe(subject, cb=cb))

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                pass
        self._subs.clear()


async def make_kv_router(runtime: Any, entry: Any, card: Any, client: Any, cfg: Any) -> KvRouterPolicy:
    nats = runtime.nats

    def publisher(subject: str):
        def publish(event: dict[str, Any]) -> Any:
            return nats.publish(subject, orjson.dumps(event))
        return publish

    router = KvRouter(
        block_size=card.kv_cache_block_size,
        overlap_score_weight=cfg.kv_overlap_score_weight,
        temperature=cfg.router_temperature,
        use_kv_events=cfg.use_kv_events,
        publish_hit_rate=publisher(namespace_event_subject(entry.namespace, "kv-hit-rate")),
        publish_active_sequence=publisher(
            component_event_subject(entry.namespace, entry.component, "active_sequences_events")),
    )
    policy = KvRouterPolicy(router, nats)
    if cfg.use_kv_events:
        await policy.subscribe(component_event_subject(entry.namespace, entry.component, "kv_events"),
                               router.apply_event)
    await policy.subscribe(component_event_subject(entry.namespace, entry.component, "active_sequences_events"),
                           router.apply_active_sequence_event)
    log.info("KV router for %s: block size %d, overlap weight %.2f, temperature %.2f, %s",
             entry.name, card.kv_cache_block_size, cfg.kv_overlap_score_weight, cfg.router_temperature,
             "KV events" if cfg.use_kv_events else "approximate (no KV events)")
    return policy


def worker_event_publishers(endpoint: Any) -> tuple[Any, Any]:
    """(publish_kv_event, publish_metrics) callbacks for an engine serving on ``endpoint``."""
    nats = endpoint.runtime.nats
    ident = endpoint.id
    kv_subject = component_event_subject(ident.namespace, ident.component, "kv_events")
    metrics_subject = namespace_event_subject(ident.namespace, "kv_metrics")

    def publish_kv_event(event: dict[str, Any]) -> Any:
        return nats.publish(kv_subject, orjson.dumps(event))

    def publish_metrics(metrics: dict[str, Any]) -> Any:
        return nats.publish(metrics_subject, orjson.dumps(metrics))

    return publish_kv_event, publish_metrics


async def serve_load_metrics(endpoint: Any, engine: Any) -> asyncio.Task[None]:
    """A ``load_metrics`` endpoint beside ``generate`` answering with the engine's current metrics."""
    comp = endpoint.component
    metrics_ep = comp.endpoint("load_metrics")

    async def handler(request: Any):
        for metrics in engine.all_load_metrics():
            yield metrics

    return asyncio.create_task(metrics_ep.serve_endpoint(handler), name="load-metrics")
