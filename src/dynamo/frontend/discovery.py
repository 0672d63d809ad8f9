"""Frontend discovery (``out=dyn``): follow the ``v1/mdc`` records and keep the ModelManager in step.

Every worker announces its model there, ours and Dynamo 1.x's alike (llm/v1_card.py reads either into a
ModelEntry); a model served by workers of both kinds is one model over all their instances.

A model appears when its first worker registers and disappears when its last one goes (each worker's
entry is bound to its lease, so a dead worker's entry vanishes when the lease expires; the transport
notices sooner and routes around it).  A name registered on several endpoints is served from all of
their instances.  This module is the watch loop and its bookkeeping; what serves a model (client,
router, pipeline) is built by model_builder.py, and prefill entries (``--disaggregation-mode prefill``
workers) are kept apart, per model name, in prefill_pool.py: a Backend model's engine sends requests to
them first when there are any (frontend/disagg.py).  A LoRA adapter is a model of its own, announced by
each worker that loaded it (its card's ``lora``): its requests go only to those workers, and its KV
router hashes prompts with the adapter's salt (kv/hashing.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from dynamo.aio import cancel_and_wait
from dynamo.frontend.lora_fleet import LoraFleet
from dynamo.frontend.model_builder import EndpointKey, ModelBuilder, RemoteModel, worker_added
from dynamo.frontend.model_manager import ModelManager
from dynamo.frontend.prefill_pool import PrefillPool
from dynamo.frontend.remote import QueuePolicy, RouterConfig
from dynamo.llm.model_entry import ModelEntry
from dynamo.llm.model_type import ModelType
from dynamo.llm.v1_card import entry_from_record
from dynamo.run_config import RunConfig
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.v1_records import models_prefix

if TYPE_CHECKING:  # the HTTP service's metrics: the frontend package imports it only to annotate
    from dynamo.frontend.http.metrics import FrontendMetrics

log = logging.getLogger(__name__)


class ModelWatcher:
    """Keeps the ModelManager in step with the ``v1/mdc`` records.

    Rules: a model name is served from the union of the live instances of every endpoint that registered
    it (:class:`ModelClient`); the first entry seen decides the model's type and card, and an entry of
    another type under the same name is ignored with a warning. An entry that cannot be added (its card
    cannot be loaded, etcd or NATS failed meanwhile) is retried with backoff for as long as it exists.
    While etcd is down nothing changes here (the watches retry by themselves), so requests keep going to
    the workers already known.
    """

    RETRY_FIRST = 1.0  # seconds before the first retry of an entry that failed to load; doubles
    RETRY_CAP = 30.0

    def __init__(self, runtime: Any, manager: ModelManager, router: RouterConfig, metrics: Any = None,
                 namespace: str | None = None, namespace_prefix: str | None = None):
        self.runtime = runtime
        # records are keyed v1/mdc/<namespace>/...: one namespace, or the namespaces starting with a prefix
        # (1.x's --namespace-prefix, which wins over --namespace), is a narrower watch, nothing to filter
        self.prefix = models_prefix() + namespace_prefix if namespace_prefix else models_prefix(namespace)
        self.manager = manager
        self.router_config = router
        self._entries: dict[str, ModelEntry] = {}  # etcd key -> entry
        self.served: dict[str, RemoteModel] = {}  # model name -> what serves it
        self._task: asyncio.Task[None] | None = None
        self._watch: Any = None
        self._lock = asyncio.Lock()  # watch events and retries change the state one at a time
        self._retries: dict[str, asyncio.Task[None]] = {}
        self._type_warned: set[str] = set()
        self._skipped: set[str] = set()  # keys of records we do not serve, already said
        manager.instances = self.instances
        # per-worker load gauges on the HTTP service's /metrics (its FrontendMetrics), if it has one
        self.worker_metrics: Any = None
        self.metrics = metrics
        router_metrics: Any = None
        if metrics is not None:
            from dynamo.frontend.model_metrics import ModelLimitsCollector
            from dynamo.frontend.router_metrics import RouterMetrics
            from dynamo.frontend.worker_metrics import QueueCollector, WorkerMetrics

            self.worker_metrics = WorkerMetrics(runtime, metrics.registry, metrics.prefix, self._kv_router_for)
            metrics.registry.register(QueueCollector(self.queued, metrics.prefix))
            metrics.registry.register(ModelLimitsCollector(self._model_limits, metrics.prefix))
            router_metrics = RouterMetrics(metrics.registry, runtime.instance_hex)
        # disaggregated serving: the prefill workers, and where prompts were prefilled
        self.prefill = PrefillPool(metrics)
        self.builder = ModelBuilder(runtime, router, prefill_engine=self.prefill.engine,
                                    prefill_stats=self.prefill.stats, observer=self._observer,
                                    router_metrics=None if router_metrics is None else
                                    lambda e: router_metrics.for_router(e.namespace, e.component, e.name))
        # /v1/load_lora_adapter and /v1/unload_lora_adapter, sent on to the workers
        self.loras = LoraFleet(runtime, manager, self.entries)
        manager.loras = self.loras

    def _model_limits(self) -> list[tuple[str, Any, bool]]:
        return [(name, served.limits, bool(served.client.instance_ids())) for name, served in list(self.served.items())]

    def _observer(self, name: str) -> Any:
        if self.worker_metrics is None:
            return None
        return self.worker_metrics.observer(name, self.metrics)

    async def start(self) -> None:
        self._watch = await self.runtime.discovery().watch_prefix(self.prefix).start()
        self._task = asyncio.create_task(self._run(), name="model-watcher")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for task in list(self._retries.values()):
            await cancel_and_wait(task)
        self._retries.clear()
        if self._watch is not None:
            await self._watch.close()
        for served in [*self.served.values(), *self.prefill.served.values()]:
            if served.router is not None:
                await served.router.close()
        for client in self.builder.clients.values():
            await client.close()
        if self.worker_metrics is not None:
            await self.worker_metrics.close()
        await self.loras.close()

    def entries(self) -> list[ModelEntry]:
        """The model entries of every worker, as discovered."""
        return list(self._entries.values())

    def instances(self) -> list[dict[str, Any]]:
        out = []
        for (ns, comp, ep), client in self.builder.clients.items():
            for iid in client.instance_ids():
                out.append({"endpoint": f"dyn://{ns}.{comp}.{ep}", "instance_id": iid,
                            "models": [s.name for s in self.served.values() if (ns, comp, ep) in s.endpoints]})
        return out

    async def _run(self) -> None:
        async for event in self._watch:
            async with self._lock:
                if event.kind == "put":
                    await self._on_put(event.key, event.value)
                else:
                    await self._on_delete(event.key)
                self.manager.notify()  # run-time LoRA loads wait for their workers' entries

    async def _on_put(self, key: str, value: bytes) -> None:
        try:
            entry = entry_from_record(value)
        except (ValueError, KeyError, TypeError) as e:  # malformed JSON is a ValueError too
            said = key in self._skipped
            await self._on_delete(key)  # a record replaced by one we do not serve
            self._skipped.add(key)
            if not said:
                log.warning("skipping model record %s: %s", key, e)
            return
        self._entries[key] = entry
        self._cancel_retry(key)
        try:
            await self._add(key, entry)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad entry must not stop discovery: retry it
            self._schedule_retry(key, entry, e)

    async def _add(self, key: str, entry: ModelEntry) -> None:
        if self.worker_metrics is not None:
            await self.worker_metrics.add_worker(entry.namespace, entry.component, entry.instance_id, entry.name,
                                                 entry.endpoint)
        ep_key: EndpointKey = (entry.namespace, entry.component, entry.endpoint)
        # the worker's --max-inflight: round-robin/random/kv skip it when full, requests queue when all are
        (await self.builder.client_for(ep_key)).set_instance_limit(
            entry.instance_id, (entry.runtime_config or {}).get("max_inflight_requests"))
        if entry.model_type is ModelType.Prefill:
            await self._add_prefill(key, entry, ep_key)
            return
        served = self.served.get(entry.name)
        if served is not None:
            if entry.model_type is not served.model_type:
                if key not in self._type_warned:
                    self._type_warned.add(key)
                    log.warning("model %s: ignoring %s's %s entry; the model is served as %s", entry.name,
                                "dyn://%s.%s.%s" % ep_key, entry.model_type.value, served.model_type.value)
                return
            if await self.builder.join(served, key, entry, ep_key):
                log.info("model %s: also served by dyn://%s.%s.%s (requests go to the instances of %d endpoints)",
                         entry.name, *ep_key, len(served.endpoints))
            _allow_adapter_worker(served, entry)
            worker_added(served.router, entry)
            return
        built = await self.builder.build(key, entry, ep_key)
        if built is None:
            if key not in self._type_warned:
                self._type_warned.add(key)
                log.warning("model %s: %s models are not served by this frontend", entry.name, entry.model_type.value)
            return
        served, model = built
        self.served[entry.name] = served
        _allow_adapter_worker(served, entry)
        worker_added(served.router, entry)
        self.manager.add(model)
        log.info("added model %s (%s) served by dyn://%s.%s.%s", entry.name, entry.model_type.value, *ep_key)

    async def _add_prefill(self, key: str, entry: ModelEntry, ep_key: EndpointKey) -> None:
        """A prefill worker of ``entry.name``: its own client and router (KV-aware under kv mode)."""
        served = self.prefill.served.get(entry.name)
        if served is not None:
            await self.builder.join(served, key, entry, ep_key)
            return
        self.prefill.served[entry.name] = await self.builder.build_prefill(key, entry, ep_key)
        log.info("model %s: prefill workers at dyn://%s.%s.%s (disaggregated serving)", entry.name, *ep_key)

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
                if entry.name in self.served:
                    log.info("model %s (%s): added after %d retr%s", entry.name, key, attempt + 1,
                             "y" if attempt == 0 else "ies")

        self._retries[key] = asyncio.create_task(retry(), name=f"model-retry:{key}")

    def _cancel_retry(self, key: str) -> None:
        task = self._retries.pop(key, None)
        if task is not None:
            task.cancel()

    def _kv_router_for(self, model: str) -> Any:
        """The KV router of a served model (name lowercased), or None: the per-worker load gauges' source."""
        for name, served in self.served.items():
            if name.lower() == model:
                return served.router.kv_router if served.router is not None else None
        return None

    def queued(self) -> dict[str, int]:
        """Requests waiting for a worker with room, per served model (name lowercased)."""
        out: dict[str, int] = {}
        for name, served in self.served.items():
            clients = served.client.clients
            # with several endpoints a waiter waits in each of their queues: the longest is the count
            out[name.lower()] = max((c.queued() for c in clients), default=0)
        return out

    async def _on_delete(self, key: str) -> None:
        self._cancel_retry(key)
        self._skipped.discard(key)
        self._type_warned.discard(key)
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if self.worker_metrics is not None:
            self.worker_metrics.remove_worker(entry.instance_id, entry.name)
        pool = self.prefill.served if entry.model_type is ModelType.Prefill else self.served
        served = pool.get(entry.name)
        if served is None:
            return
        ep_key = (entry.namespace, entry.component, entry.endpoint)
        keys = served.endpoints.get(ep_key)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        if served.client.only is not None:
            served.client.only.discard(entry.instance_id)
        if served.router is not None:
            served.router.remove_worker(entry.instance_id)
        if not keys:
            del served.endpoints[ep_key]
            client = self.builder.clients.get(ep_key)
            if client is not None and served.endpoints:
                served.client.remove(client)
        if not served.endpoints:
            del pool[entry.name]
            if pool is self.served:
                self.manager.remove(entry.name)
            if served.router is not None:
                await served.router.close()
            if pool is self.served:
                log.info("removed model %s: no worker serves it any more", entry.name)
            else:
                log.info("model %s: no prefill worker any more; prefilling on the decode workers", entry.name)


def _allow_adapter_worker(served: RemoteModel, entry: ModelEntry) -> None:
    """A LoRA adapter's model goes only to the workers whose entries announce it."""
    if (entry.card or {}).get("lora"):
        if served.client.only is None:
            served.client.only = set()
        served.client.only.add(entry.instance_id)


async def start_frontend(cfg: RunConfig, metrics: FrontendMetrics | None = None
                         ) -> tuple[DistributedRuntime, ModelManager, ModelWatcher]:
    """Connect the runtime and start following models; the caller serves the manager.  With ``metrics``
    (the HTTP service's FrontendMetrics) the workers' load is exported there too."""
    from dynamo.runtime.distributed import connect_runtime

    runtime = await connect_runtime(discovery_backend=cfg.discovery_backend, request_plane=cfg.request_plane,
                                    event_plane=cfg.event_plane)
    manager = ModelManager()
    watcher = ModelWatcher(runtime, manager, RouterConfig(
        mode=cfg.router_mode, kv_overlap_score_weight=cfg.kv_overlap_score_weight,
        router_temperature=cfg.router_temperature, use_kv_events=cfg.use_kv_events,
        router_replica_sync=cfg.router_replica_sync,
        migration_limit=cfg.migration_limit,
        queue=QueuePolicy(size=cfg.queue_size, timeout=cfg.queue_timeout),
        max_local_prefill_length=cfg.max_local_prefill_length,
    ), metrics=metrics, namespace=cfg.namespace, namespace_prefix=cfg.namespace_prefix)
    try:
        await watcher.start()
    except BaseException:
        await runtime.close()
        raise
    return runtime, manager, watcher
