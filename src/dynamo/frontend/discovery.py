"""Frontend discovery (``out=dyn``): follow ``models/`` in etcd and keep the ModelManager in step.

A model appears when its first worker registers and disappears when its last one goes (each worker's
entry is bound to its lease, so a dead worker's entry vanishes when the lease expires; the transport
notices sooner and routes around it).  A name registered on several endpoints is served from all of
their instances.  Backend models get our pre/post-processing with the card's
tokenizer and template in front of a :class:`RemoteCoreEngine`; Chat/Completion models are forwarded.
Prefill entries (``--disaggregation-mode prefill`` workers) are kept apart, per model name: a Backend
model's engine sends requests to them first when there are any (frontend/disagg.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from dynamo.aio import cancel_and_wait
from dynamo.disagg.plan import DisaggStats
from dynamo.frontend.disagg import DisaggCoreEngine
from dynamo.frontend.model_client import ModelClient
from dynamo.frontend.model_manager import ModelManager
from dynamo.frontend.remote import QueuePolicy, RemoteChatEngine, RemoteCoreEngine, SimpleRouter
from dynamo.llm.model_entry import MODELS_PREFIX, ModelEntry, load_card
from dynamo.llm.model_type import ModelType
from dynamo.llm.pipeline import CorePipeline, FullPipeline
from dynamo.runtime.names import component_event_subject

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    mode: str = "round-robin"
    kv_overlap_score_weight: float = 2.0  # as --kv-overlap-score-weight; the original: 1.0 (docs/routing.md)
    router_temperature: float = 0.0
    use_kv_events: bool = True
    # --migration-limit on the frontend: a request may move this many times, or as many as the worker's
    # card allows if that is more (Dynamo 1.x sets it on the frontend, 0.x on the worker)
    migration_limit: int = 0
    queue: QueuePolicy = field(default_factory=QueuePolicy)  # --queue-size / --queue-timeout
    max_local_prefill_length: int | None = None  # disaggregation: None is disagg/plan.py's default


@dataclass
class _Served:
    name: str
    model_type: ModelType
    client: ModelClient
    endpoints: dict[tuple[str, str, str], set[str]] = field(default_factory=dict)  # endpoint -> entry keys
    router: Any = None
    engine: Any = None  # prefill entries: the RemoteCoreEngine over the prefill workers

    @property
    def entries(self) -> set[str]:
        return {key for keys in self.endpoints.values() for key in keys}


class ModelWatcher:
    """Keeps the ModelManager in step with ``models/`` in etcd.

    Rules: a model name is served from the union of the live instances of every endpoint that registered
    it (:class:`ModelClient`); the first entry seen decides the model's type and card, and an entry of
    another type under the same name is ignored with a warning. An entry that cannot be added (its card
    cannot be loaded, etcd or NATS failed meanwhile) is retried with backoff for as long as it exists.
    While etcd is down nothing changes here (the watches retry by themselves), so requests keep going to
    the workers already known.
    """

    RETRY_FIRST = 1.0  # seconds before the first retry of an entry that failed to load; doubles
    RETRY_CAP = 30.0

    def __init__(self, runtime: Any, manager: ModelManager, router: RouterConfig, metrics: Any = None):
        self.runtime = runtime
        self.manager = manager
        self.router_config = router
        self._entries: dict[str, ModelEntry] = {}  # etcd key -> entry
        self._served: dict[str, _Served] = {}  # model name -> what serves it
        self._prefill: dict[str, _Served] = {}  # model name -> its prefill workers (disaggregation)
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._watch: Any = None
        self._lock = asyncio.Lock()  # watch events and retries change the state one at a time
        self._retries: dict[str, asyncio.Task[None]] = {}
        self._type_warned: set[str] = set()
        manager.instances = self.instances
        # per-worker load gauges on the HTTP service's /metrics (its FrontendMetrics), if it has one
        self.worker_metrics: Any = None
        self.metrics = metrics
        if metrics is not None:
            from dynamo.frontend.worker_metrics import WorkerMetrics

            self.worker_metrics = WorkerMetrics(runtime, metrics.registry, metrics.prefix, self._kv_router_for)
            metrics.registry.register(_QueueCollector(self, metrics.prefix))
        # disaggregated serving: where prompts were prefilled (remote; local, including fallbacks; fallback)
        self._prefill_counter: Any = None
        if metrics is not None:
            from prometheus_client import Counter

            self._prefill_counter = Counter(
                f"{metrics.prefix}_disagg_prefill", "Prompts by where they were prefilled: remote (a prefill "
                "worker), local (the decode worker; includes fallbacks), fallback (a remote prefill that failed)",
                ["model", "where"], registry=metrics.registry)

    async def start(self) -> None:
        self._watch = await self.runtime.discovery().watch_prefix(MODELS_PREFIX).start()
        self._task = asyncio.create_task(self._run(), name="model-watcher")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for task in list(self._retries.values()):
            await cancel_and_wait(task)
        self._retries.clear()
        if self._watch is not None:
            await self._watch.close()
        for served in [*self._served.values(), *self._prefill.values()]:
            close = getattr(served.router, "close", None)
            if close is not None:
                await close()
        for client in self._clients.values():
            await client.close()
        if self.worker_metrics is not None:
            await self.worker_metrics.close()

    def instances(self) -> list[dict[str, Any]]:
        out = []
        for (ns, comp, ep), client in self._clients.items():
            for iid in client.instance_ids():
                out.append({"endpoint": f"dyn://{ns}.{comp}.{ep}", "instance_id": iid,
                            "models": [s.name for s in self._served.values() if (ns, comp, ep) in s.endpoints]})
        return out

    async def _run(self) -> None:
        async for event in self._watch:
            async with self._lock:
                if event.kind == "put":
                    await self._on_put(event.key, event.value)
                else:
                    await self._on_delete(event.key)

    async def _on_put(self, key: str, value: bytes) -> None:
        try:
            entry = ModelEntry.from_json(value)
        except Exception as e:
            log.warning("skipping malformed model entry %s: %s", key, e)
            return
        self._entries[key] = entry
        self._cancel_retry(key)
        try:
            await self._add(key, entry)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad entry must not stop discovery: retry it
            self._schedule_retry(key, entry, e)

    async def _client_for(self, ep_key: tuple[str, str, str]) -> Any:
        client = self._clients.get(ep_key)
        if client is None:
            ns, comp, ep = ep_key
            client = await self.runtime.namespace(ns).component(comp).endpoint(ep).client()
            self._clients[ep_key] = client
        return client

    async def _add(self, key: str, entry: ModelEntry) -> None:
        if self.worker_metrics is not None:
            await self.worker_metrics.add_worker(entry.namespace, entry.component, entry.instance_id, entry.name)
        ep_key = (entry.namespace, entry.component, entry.endpoint)
        # the worker's --max-inflight: round-robin/random/kv skip it when full, requests queue when all are
        (await self._client_for(ep_key)).set_instance_limit(
            entry.instance_id, (entry.runtime_config or {}).get("max_inflight_requests"))
        if entry.model_type is ModelType.Prefill:
            await self._add_prefill(key, entry, ep_key)
            return
        served = self._served.get(entry.name)
        if served is not None:
            if entry.model_type is not served.model_type:
                if key not in self._type_warned:
                    self._type_warned.add(key)
                    log.warning("model %s: ignoring %s's %s entry; the model is served as %s", entry.name,
                                "dyn://%s.%s.%s" % ep_key, entry.model_type.value, served.model_type.value)
                return
            if ep_key not in served.endpoints:
                served.client.add(await self._client_for(ep_key))
                await self._extend_router(served, entry)
                log.info("model %s: also served by dyn://%s.%s.%s (requests go to the instances of %d endpoints)",
                         entry.name, *ep_key, len(served.endpoints) + 1)
            served.endpoints.setdefault(ep_key, set()).add(key)
            _worker_added(served.router, entry)
            return
        client = ModelClient([await self._client_for(ep_key)])
        card = await load_card(self.runtime.nats, entry.card)
        observer = None  # per-worker timing and migration counts on /metrics
        if self.worker_metrics is not None:
            observer = self.worker_metrics.observer(entry.name, self.metrics.migrated)
        card.display_name = entry.name
        served = _Served(entry.name, entry.model_type, client, {ep_key: {key}})
        if entry.model_type is ModelType.Backend:
            served.router = await self._make_router(entry, card, client)
            engine: Any = RemoteCoreEngine(client, served.router, queue=self.router_config.queue,
                                           migration_limit=max(card.migration_limit, self.router_config.migration_limit),
                                           observer=observer)
            name = entry.name
            engine = DisaggCoreEngine(engine, lambda: self._prefill_engine(name),
                                      max_local_prefill_length=self.router_config.max_local_prefill_length,
                                      stats=DisaggStats(self._observe_prefill(entry.name)))
            model: Any = CorePipeline(entry.name, card, engine)
        elif entry.model_type in (ModelType.Chat, ModelType.Completion):
            chat_engine: Any = RemoteChatEngine(client, self.router_config.queue, observer=observer)
            model = FullPipeline(entry.name, card, chat_engine)
        elif entry.model_type is ModelType.Embedding:
            from dynamo.frontend.remote_embeddings import RemoteEmbeddingEngine
            from dynamo.llm.embeddings import EmbeddingModel
            from dynamo.llm.tokenizer import Tokenizer

            tokenizer = Tokenizer(card.tokenizer_json) if card.has_tokenizer else None  # type: ignore[arg-type]
            engine = RemoteEmbeddingEngine(client, entry.name, tokenizer)  # token_ids on the wire, as the spec has
            model = EmbeddingModel(entry.name, card, engine, tokenizer=tokenizer)
        else:
            if key not in self._type_warned:
                self._type_warned.add(key)
                log.warning("model %s: %s models are not served by this frontend", entry.name, entry.model_type.value)
            return
        self._served[entry.name] = served
        _worker_added(served.router, entry)
        self.manager.add(model)
        log.info("added model %s (%s) served by dyn://%s.%s.%s", entry.name, entry.model_type.value, *ep_key)

    def _observe_prefill(self, name: str) -> Any:
        if self._prefill_counter is None:
            return None
        counter = self._prefill_counter
        return lambda kind: counter.labels(model=name, where=kind).inc()

    def _prefill_engine(self, name: str) -> Any:
        served = self._prefill.get(name)
        return served.engine if served is not None else None

    async def _add_prefill(self, key: str, entry: ModelEntry, ep_key: tuple[str, str, str]) -> None:
        """A prefill worker of ``entry.name``: its own client and router (KV-aware under kv mode)."""
        served = self._prefill.get(entry.name)
        if served is not None:
            if ep_key not in served.endpoints:
                served.client.add(await self._client_for(ep_key))
                await self._extend_router(served, entry)
            served.endpoints.setdefault(ep_key, set()).add(key)
            return
        client = ModelClient([await self._client_for(ep_key)])
        card = await load_card(self.runtime.nats, entry.card)
        served = _Served(entry.name, entry.model_type, client, {ep_key: {key}})
        served.router = await self._make_router(entry, card, client)
        # no migration and no waiting for a prefill: when it fails or every prefill worker is full, the
        # decode worker prefills locally at once (a 503 here is a fallback, not an error for the client)
        served.engine = RemoteCoreEngine(client, served.router, migration_limit=0, queue=QueuePolicy(size=0, timeout=0.0))
        self._prefill[entry.name] = served
        log.info("model %s: prefill workers at dyn://%s.%s.%s (disaggregated serving)", entry.name, *ep_key)

    async def _extend_router(self, served: _Served, entry: ModelEntry) -> None:
        """A KV router also follows the KV events of another component serving the model."""
        policy = served.router
        kv = getattr(policy, "router", None)
        subscribe = getattr(policy, "subscribe", None)
        if kv is None or subscribe is None:
            return
        if any(ns == entry.namespace and comp == entry.component for ns, comp, _ in served.endpoints):
            return
        if getattr(kv, "use_kv_events", False):  # the router follows KV events (not the approximate indexer)
            await subscribe(component_event_subject(entry.namespace, entry.component, "kv_events"), kv.apply_event)
        await subscribe(component_event_subject(entry.namespace, entry.component, "active_sequences_events"),
                        kv.apply_active_sequence_event)

    def _schedule_retry(self, key: str, entry: ModelEntry, error: BaseException, attempt: int = 0) -> None:
        delay = min(self.RETRY_FIRST * (2 ** attempt), self.RETRY_CAP)
        (log.warning if attempt == 0 else log.debug)(
            "model %s (%s): cannot add it yet (%s); retrying in %.0fs", entry.name, key, error, delay)

        async def retry() -> None:
            await asyncio.sleep(delay)
            async with self._lock:
                if self._retries.get(key) is not asyncio.current_task():
                    return
                del self._retries[key]
                if self._entries.get(key) is not entry:
                    return  # deleted or replaced meanwhile
                try:
                    await self._add(key, entry)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001
                    self._schedule_retry(key, entry, e, attempt + 1)
                    return
                if entry.name in self._served:
                    log.info("model %s (%s): added after %d retr%s", entry.name, key, attempt + 1,
                             "y" if attempt == 0 else "ies")

        self._retries[key] = asyncio.create_task(retry(), name=f"model-retry:{key}")

    def _cancel_retry(self, key: str) -> None:
        task = self._retries.pop(key, None)
        if task is not None:
            task.cancel()

    def _kv_router_for(self, model: str) -> Any:
        """The KV router of a served model (name lowercased), or None: the per-worker load gauges' source."""
        for name, served in self._served.items():
            if name.lower() == model:
                return getattr(served.router, "router", None)
        return None

    def queued(self) -> dict[str, int]:
        """Requests waiting for a worker with room, per served model (name lowercased)."""
        out: dict[str, int] = {}
        for name, served in self._served.items():
            clients = getattr(served.client, "clients", None) or []
            # with several endpoints a waiter waits in each of their queues: the longest is the count
            out[name.lower()] = max((c.queued() for c in clients), default=0)
        return out

    async def _make_router(self, entry: ModelEntry, card: Any, client: Any) -> Any:
        cfg = self.router_config
        if cfg.mode != "kv":
            return SimpleRouter("random" if cfg.mode == "random" else "round-robin")
        from dynamo.frontend.kv_policy import make_kv_router

        return await make_kv_router(self.runtime, entry, card, client, cfg)

    async def _on_delete(self, key: str) -> None:
        self._cancel_retry(key)
        self._type_warned.discard(key)
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if self.worker_metrics is not None:
            self.worker_metrics.remove_worker(entry.instance_id, entry.name)
        pool = self._prefill if entry.model_type is ModelType.Prefill else self._served
        served = pool.get(entry.name)
        if served is None:
            return
        ep_key = (entry.namespace, entry.component, entry.endpoint)
        keys = served.endpoints.get(ep_key)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        instance_gone = getattr(served.router, "remove_worker", None)
        if instance_gone is not None:
            instance_gone(entry.instance_id)
        if not keys:
            del served.endpoints[ep_key]
            client = self._clients.get(ep_key)
            if client is not None and served.endpoints:
                served.client.remove(client)
        if not served.endpoints:
            del pool[entry.name]
            if pool is self._served:
                self.manager.remove(entry.name)
            close = getattr(served.router, "close", None)
            if close is not None:
                await close()
            if pool is self._served:
                log.info("removed model %s: no worker serves it any more", entry.name)
            else:
                log.info("model %s: no prefill worker any more; prefilling on the decode workers", entry.name)


def _worker_added(router: Any, entry: ModelEntry) -> None:
    added = getattr(router, "add_worker", None)  # KV routers ask a new worker what it caches
    if added is not None:
        added(entry)


async def start_frontend(cfg: Any, metrics: Any = None) -> tuple[Any, ModelManager, ModelWatcher]:
    """Connect the runtime and start following models; the caller serves the manager.  With ``metrics``
    (the HTTP service's FrontendMetrics) the workers' load is exported there too."""
    from dynamo.runtime.distributed import connect_runtime

    runtime = await connect_runtime()
    manager = ModelManager()
    watcher = ModelWatcher(runtime, manager, RouterConfig(
        mode=cfg.router_mode, kv_overlap_score_weight=cfg.kv_overlap_score_weight,
        router_temperature=cfg.router_temperature, use_kv_events=cfg.use_kv_events,
        migration_limit=cfg.migration_limit,
        queue=QueuePolicy(size=cfg.queue_size, timeout=cfg.queue_timeout),
        max_local_prefill_length=getattr(cfg, "max_local_prefill_length", None),
    ), metrics=metrics)
    try:
        await watcher.start()
    except BaseException:
        await runtime.close()
        raise
    return runtime, manager, watcher


class _QueueCollector:
    """``<prefix>_router_queue_pending_requests``: requests waiting because every worker is at its
    limit (``--queue-size``), read when /metrics is scraped."""

    def __init__(self, watcher: Any, prefix: str) -> None:
        self.watcher = watcher
        self.name = f"{prefix}_router_queue_pending_requests"

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.name, "Requests waiting for a worker with room (every worker at its limit)",
                                   labels=["model", "worker_type"])
        for model, n in sorted(self.watcher.queued().items()):
            family.add_metric([model, "decode"], n)
        yield family
