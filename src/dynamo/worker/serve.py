"""``in=dyn://namespace.component.endpoint``: serve an engine as a worker on the distributed runtime.

Order matters for a clean life cycle: the endpoint starts serving (its instance key appears) before the
model entry is published, so a frontend never routes to a model with no instance; on SIGINT/SIGTERM the
lease is revoked first (the entry and instance key vanish at once, frontends stop routing here), then
in-flight requests finish (up to ``--drain-timeout``; those still running then are handed back to the
frontends, which resume them on other workers), then the process exits 0.  This is how a planner (or
any orchestrator) scales a fleet down without failing a request: it sends SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import cast

from dynamo.disagg.prefix_share import SHARING_ENV, PrefixSharingEngine, SharingChoice, choose_sharing
from dynamo.engines.served_model import build_served_model
from dynamo.errors import UserError
from dynamo.heap import settle_heap
from dynamo.llm.embeddings import embedding_handler
from dynamo.llm.engine import (
    Engine,
    EngineCapabilities,
    LendsKvPrefixes,
    ServesLoraAdapters,
    capabilities_of,
    close_engine,
)
from dynamo.llm.lora import RUNTIME_LORA_KEY, runtime_lora_allowed
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_entry import PUBLISHES_KV_EVENTS
from dynamo.llm.model_type import ModelType
from dynamo.llm.register import publish_model
from dynamo.run_config import RunConfig
from dynamo.runtime import EndpointId
from dynamo.runtime.distributed import DistributedRuntime, connect_runtime
from dynamo.runtime.fleet_auth import FleetAuth
from dynamo.runtime.tcp import advertise_host
from dynamo.worker.handlers import backend_handler, chat_handler
from dynamo.worker.kv_publishing import KvPublishing, check_no_second_form, serve_load_metrics
from dynamo.worker.lora_control import LoraControl

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT = 512  # --max-inflight for engines that do not say how many requests they run at once
ENGINE_QUEUE_FACTOR = 2  # the default --max-inflight of an engine with slots: its slots, and as many queued


async def prefix_sharing(runtime: DistributedRuntime) -> tuple[SharingChoice, FleetAuth | None]:
    """Whether this worker lends its cached prefixes (``DYN_KV_PREFIX_SHARING``, on where it is safe), and
    the keys its share server proves: the fleet secret's, else this machine's private store's."""
    setting = os.environ.get(SHARING_ENV)
    hosts = runtime.listen_hosts
    loopback = hosts is not None and hosts.loopback
    fleet = runtime.fleet_auth is not None
    choice = choose_sharing(setting, fleet_secret=fleet, loopback=loopback, private_store=True)
    if choice.auth != "machine":
        return choice, runtime.fleet_auth if choice.auth == "fleet" else None
    machine = await runtime.machine_auth()  # (the store's secret is made only when it is used)
    if machine is None:
        return choose_sharing(setting, fleet_secret=fleet, loopback=loopback, private_store=False), None
    return choice, machine


def max_inflight(cfg: RunConfig, caps: EngineCapabilities) -> int:
    """The worker's limit of requests in flight: --max-inflight, else ``ENGINE_QUEUE_FACTOR`` times the
    engine's capacity (its slots, and as many again waiting in its own queue), else 512.

    Why a queue on the worker at all: a frontend never sends a worker more than its limit, so at a limit of
    exactly the slots, once every slot of the fleet was busy a request went to whichever worker freed a
    slot first, and the KV router had no choice left: with 8 clients on two 4-slot llama.cpp workers, 87 of
    94 decisions had one candidate, and the engines reused 0.58 of the prompt tokens against 0.66 for the
    routers that let the engines queue.  With a queue as deep as the slots, the router weighs the holder's
    queue against computing the prompt elsewhere: every decision had both candidates, hits rose to the
    peers' and tokens/s by 15-22 % (docs/routing.md, "Room to choose").  The overload bound stays: past
    the limit, requests wait in the frontend's queue and then get a 503."""
    if cfg.max_inflight:
        return cfg.max_inflight
    return ENGINE_QUEUE_FACTOR * caps.capacity if caps.capacity else DEFAULT_MAX_INFLIGHT


async def run_worker(cfg: RunConfig, card: ModelCard, engine_name: str, stop: asyncio.Event) -> int:
    ident = EndpointId.parse(cfg.input)
    check_no_second_form()  # a setting that cannot be honoured stops the worker before it joins the fleet
    runtime = await connect_runtime(discovery_backend=cfg.discovery_backend, request_plane=cfg.request_plane,
                                    event_plane=cfg.event_plane)
    owned: object | None = None  # the engine to close on the way out (the disagg wrapper closes its engine)
    try:
        endpoint = runtime.namespace(ident.namespace).component(ident.component).endpoint(ident.name)
        await endpoint.component.create_service()
        served = await build_served_model(cfg, card, engine_name)
        owned = served.engine
        engine = cast(Engine, served.engine)
        caps = capabilities_of(engine)
        publishes_kv_events = False
        if caps.publishes_kv:  # engines that publish KV events and load metrics (mocker, llamacpp, vllm, ...)
            kv = await KvPublishing.start(endpoint)  # None: a static runtime, where no router can follow them
            publish_kv_event, publish_metrics = kv.callbacks() if kv is not None else (None, None)
            engine.attach(endpoint.lease_id(), publish_kv_event=publish_kv_event,  # type: ignore[attr-defined]
                          publish_metrics=publish_metrics)
            await serve_load_metrics(endpoint, engine)  # type: ignore[arg-type]
            publishes_kv_events = bool(engine.publishes_kv_events)  # type: ignore[attr-defined]
            if publishes_kv_events and kv is not None:
                await kv.serve_recovery(engine if caps.dumps_kv_state else None)
        mode = cfg.disaggregation_mode
        if mode != "agg" and caps.state_io:
            # engines that export/import sequence state get the real KV hand-over (the mocker simulates it)
            from dynamo.disagg.worker import DisaggWorkerEngine

            hosts = runtime.listen_hosts  # the transfer server listens where the planes do
            wrapped = DisaggWorkerEngine(engine, mode, host=hosts.callhome if hosts else None,
                                         advertise=hosts.advertise if hosts else None, auth=runtime.fleet_auth)
            await wrapped.start()
            engine = owned = wrapped  # closed below, with its transfer server
        elif mode == "agg" and publishes_kv_events and isinstance(engine, LendsKvPrefixes):
            # a KV router may send a prompt here with another worker's cached prefix to fetch (prefix_share.py)
            sharing, auth = await prefix_sharing(runtime)
            if sharing.on:
                hosts = runtime.listen_hosts
                lending = PrefixSharingEngine(engine, host=hosts.callhome if hosts else advertise_host(os.environ.get("DYN_TCP_RPC_HOST")),
                                              advertise=hosts.advertise if hosts else None, auth=auth,
                                              why=sharing.line, warn=sharing.warn)
                await lending.start()
                engine = owned = lending  # closed below, with its share server
            else:
                log.info("%s", sharing.line)
        elif choose_sharing(os.environ.get(SHARING_ENV), fleet_secret=False, loopback=False, private_store=False).on:
            log.warning("%s=%s: this worker lends no KV prefixes (only an aggregated llamacpp worker publishing KV "
                        "events can)", SHARING_ENV, os.environ.get(SHARING_ENV))
        if engine.kind == "embedding":
            handler, model_type = embedding_handler(engine), ModelType.Embedding  # type: ignore[arg-type]
        elif engine.kind == "core":
            handler = backend_handler(card, engine,
                                      served.engine if isinstance(served.engine, ServesLoraAdapters) else None)
            model_type = ModelType.Prefill if mode == "prefill" else ModelType.Backend
        else:
            handler, model_type = chat_handler(served), ModelType.Chat
        loras: LoraControl | None = None
        ready = asyncio.Event()
        limit = max_inflight(cfg, caps)
        serving = asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready, max_inflight=limit,
                                                              drain_timeout=cfg.drain_timeout))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([serving, waiter], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            waiter.cancel()
            serving.result()  # raises why serving failed
            raise UserError(f"Endpoint service completed unexpectedly for endpoint: {ident}")
        # frontends read max_inflight_requests to route around this worker while it is full, and whether
        # they can follow this worker's cache through KV events
        runtime_config = dict(capabilities_of(engine).runtime_config, max_inflight_requests=limit)
        runtime_config[PUBLISHES_KV_EVENTS] = publishes_kv_events
        if isinstance(served.engine, ServesLoraAdapters):  # one entry per adapter: frontends route by them
            runtime_config[RUNTIME_LORA_KEY] = runtime_lora_allowed()
            loras = LoraControl(endpoint, served.engine, card, model_type, runtime_config)
            loras.serve()
        await publish_model(endpoint, card, model_type, runtime_config=runtime_config)
        if loras is not None:
            await loras.announce_all()
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
        if owned is not None:
            await close_engine(owned)
        await runtime.close()
