"""``in=dyn://namespace.component.endpoint``: serve an engine as a worker on the distributed runtime.

Order matters for a clean life cycle: the endpoint starts serving (its instance key appears) before the
model entry is published, so a frontend never routes to a model with no instance; on SIGINT/SIGTERM the
lease is revoked first (the entry and instance key vanish at once, frontends stop routing here), then
in-flight requests finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dynamo.errors import UserError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_entry import PUBLISHES_KV_EVENTS
from dynamo.llm.model_type import ModelType
from dynamo.llm.register import publish_model
from dynamo.llm.worker_handlers import backend_handler, chat_handler

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT = 512  # --max-inflight for engines that do not say how many requests they run at once


def max_inflight(cfg: Any, engine: Any) -> int:
    """The worker's limit of requests in flight: --max-inflight, else the engine's capacity, else 512."""
    return cfg.max_inflight or getattr(engine, "capacity", None) or DEFAULT_MAX_INFLIGHT


async def connect_runtime() -> Any:
    from dynamo.runtime import DistributedRuntime, RuntimeConfigError, RuntimeConnectionError

    try:
        return await DistributedRuntime.connect()
    except (RuntimeConnectionError, RuntimeConfigError) as e:
        raise UserError(str(e)) from None


async def run_worker(cfg: Any, card: ModelCard, engine_name: str, stop: asyncio.Event) -> int:
    from dynamo.run.heap import settle_heap
    from dynamo.run.launch import build_served_model
    from dynamo.runtime import EndpointId

    ident = EndpointId.parse(cfg.input)
    runtime = await connect_runtime()
    served = None
    try:
        endpoint = runtime.namespace(ident.namespace).component(ident.component).endpoint(ident.name)
        await endpoint.component.create_service()
        served = await build_served_model(cfg, card, engine_name)
        engine = served.engine  # type: ignore[attr-defined]
        attach = getattr(engine, "attach", None)
        publishes_kv_events = False
        if attach is not None:  # engines that publish KV events and load metrics (mocker, llamacpp)
            from dynamo.frontend.kv_routing import serve_kv_state, serve_load_metrics, worker_event_publishers

            publish_kv_event, publish_metrics = worker_event_publishers(endpoint)
            attach(endpoint.lease_id(), publish_kv_event=publish_kv_event, publish_metrics=publish_metrics)
            await serve_load_metrics(endpoint, engine)
            publishes_kv_events = bool(getattr(engine, "publishes_kv_events", False))
            if publishes_kv_events and hasattr(engine, "kv_state_dump"):
                await serve_kv_state(endpoint, engine)
        mode = getattr(cfg, "disaggregation_mode", "agg")
        if mode != "agg" and getattr(engine, "supports_state_io", False):
            # engines that export/import sequence state get the real KV hand-over (the mocker simulates it)
            from dynamo.llm.disagg.worker import DisaggWorkerEngine

            engine = DisaggWorkerEngine(engine, mode)
            await engine.start()
            served.engine = engine  # type: ignore[attr-defined]  # closed below, with its transfer server
        if engine.kind == "embedding":
            from dynamo.llm.embeddings import embedding_handler

            handler, model_type = embedding_handler(engine), ModelType.Embedding
        elif engine.kind == "core":
            handler = backend_handler(card, engine)
            model_type = ModelType.Prefill if mode == "prefill" else ModelType.Backend
        else:
            handler, model_type = chat_handler(served), ModelType.Chat
        ready = asyncio.Event()
        limit = max_inflight(cfg, engine)
        serving = asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready, max_inflight=limit))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([serving, waiter], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            waiter.cancel()
            serving.result()  # raises why serving failed
            raise UserError(f"Endpoint service completed unexpectedly for endpoint: {ident}")
        # frontends read max_inflight_requests to route around this worker while it is full, and whether
        # they can follow this worker's cache through KV events
        runtime_config = dict(getattr(engine, "runtime_config", None) or {}, max_inflight_requests=limit)
        runtime_config[PUBLISHES_KV_EVENTS] = publishes_kv_events
        await publish_model(endpoint, card, model_type, runtime_config=runtime_config)
        log.info("worker %s serving %s as %s (instance %x)", ident, card.display_name, model_type.value,
                 endpoint.lease_id())
        settle_heap()
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([serving, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            runtime.shutdown()  # revoke the lease: deregister first, then drain in-flight requests
            await serving
        else:
            stopper.cancel()
            serving.result()
        return 0
    finally:
        if served is not None:
            close = getattr(served.engine, "close", None)  # type: ignore[attr-defined]
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
        await runtime.close()
