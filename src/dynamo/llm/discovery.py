"""Frontend discovery (``out=dyn``): follow ``models/`` in etcd and keep the ModelManager in step.

A model appears when its first worker registers and disappears when its last one goes (each worker's
entry is bound to its lease, so a dead worker's entry vanishes when the lease expires; the transport
notices sooner and routes around it).  Backend models get our pre/post-processing with the card's
tokenizer and template in front of a :class:`RemoteCoreEngine`; Chat/Completion models are forwarded.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from dynamo.aio import cancel_and_wait
from dynamo.llm.model_entry import MODELS_PREFIX, ModelEntry, load_card
from dynamo.llm.model_manager import ModelManager
from dynamo.llm.model_type import ModelType
from dynamo.llm.pipeline import CorePipeline, FullPipeline
from dynamo.llm.remote import RemoteChatEngine, RemoteCoreEngine, SimpleRouter

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    mode: str = "round-robin"
    kv_overlap_score_weight: float = 2.0  # as --kv-overlap-score-weight; the original: 1.0 (docs/routing.md)
    router_temperature: float = 0.0
    use_kv_events: bool = True


@dataclass
class _Served:
    name: str
    endpoint_key: tuple[str, str, str]
    entries: set[str] = field(default_factory=set)
    router: Any = None


class ModelWatcher:
    def __init__(self, runtime: Any, manager: ModelManager, router: RouterConfig, metrics: Any = None):
        self.runtime = runtime
        self.manager = manager
        self.router_config = router
        self._entries: dict[str, ModelEntry] = {}  # etcd key -> entry
        self._served: dict[str, _Served] = {}  # model name -> what serves it
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._watch: Any = None
        manager.instances = self.instances
        # per-worker load gauges on the HTTP service's /metrics (its FrontendMetrics), if it has one
        self.worker_metrics: Any = None
        if metrics is not None:
            from dynamo.llm.worker_metrics import WorkerMetrics

            self.worker_metrics = WorkerMetrics(runtime, metrics.registry, metrics.prefix)

    async def start(self) -> None:
        self._watch = await self.runtime.etcd.watch_prefix(MODELS_PREFIX).start()
        self._task = asyncio.create_task(self._run(), name="model-watcher")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._watch is not None:
            await self._watch.close()
        for served in self._served.values():
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
                            "models": [s.name for s in self._served.values() if s.endpoint_key == (ns, comp, ep)]})
        return out

    async def _run(self) -> None:
        async for event in self._watch:
            try:
                if event.kind == "put":
                    await self._on_put(event.key, event.value)
                else:
                    await self._on_delete(event.key)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one bad entry must not stop discovery
                log.error("error handling model entry %s: %s", event.key, e)

    async def _on_put(self, key: str, value: bytes) -> None:
        try:
            entry = ModelEntry.from_json(value)
        except Exception as e:
            log.warning("skipping malformed model entry %s: %s", key, e)
            return
        self._entries[key] = entry
        if self.worker_metrics is not None:
            await self.worker_metrics.add_worker(entry.namespace, entry.component, entry.instance_id, entry.name)
        served = self._served.get(entry.name)
        if served is not None:
            served.entries.add(key)
            return
        ep_key = (entry.namespace, entry.component, entry.endpoint)
        client = self._clients.get(ep_key)
        if client is None:
            endpoint = self.runtime.namespace(entry.namespace).component(entry.component).endpoint(entry.endpoint)
            client = await endpoint.client()
            self._clients[ep_key] = client
        card = await load_card(self.runtime.nats, entry.card)
        card.display_name = entry.name
        served = _Served(entry.name, ep_key, {key})
        if entry.model_type is ModelType.Backend:
            served.router = await self._make_router(entry, card, client)
            engine = RemoteCoreEngine(client, served.router, migration_limit=card.migration_limit)
            model: Any = CorePipeline(entry.name, card, engine)
        elif entry.model_type in (ModelType.Chat, ModelType.Completion):
            model = FullPipeline(entry.name, card, RemoteChatEngine(client))
        else:
            log.warning("model %s: %s models are not served by this frontend", entry.name, entry.model_type.value)
            return
        # a second entry for the same name may have arrived while we loaded the card
        if entry.name in self._served:
            self._served[entry.name].entries.add(key)
            return
        self._served[entry.name] = served
        self.manager.add(model)
        log.info("added model %s (%s) served by dyn://%s.%s.%s", entry.name, entry.model_type.value, *ep_key)

    async def _make_router(self, entry: ModelEntry, card: Any, client: Any) -> Any:
        cfg = self.router_config
        if cfg.mode != "kv":
            return SimpleRouter("random" if cfg.mode == "random" else "round-robin")
        from dynamo.llm.kv_routing import make_kv_router

        return await make_kv_router(self.runtime, entry, card, client, cfg)

    async def _on_delete(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if self.worker_metrics is not None:
            self.worker_metrics.remove_worker(entry.instance_id, entry.name)
        served = self._served.get(entry.name)
        if served is None:
            return
        served.entries.discard(key)
        instance_gone = getattr(served.router, "remove_worker", None)
        if instance_gone is not None:
            instance_gone(entry.instance_id)
        if not served.entries:
            del self._served[entry.name]
            self.manager.remove(entry.name)
            close = getattr(served.router, "close", None)
            if close is not None:
                await close()
            log.info("removed model %s: no worker serves it any more", entry.name)


async def start_frontend(cfg: Any, metrics: Any = None) -> tuple[Any, ModelManager, ModelWatcher]:
    """Connect the runtime and start following models; the caller serves the manager.  With ``metrics``
    (the HTTP service's FrontendMetrics) the workers' load is exported there too."""
    from dynamo.inputs.endpoint import connect_runtime

    runtime = await connect_runtime()
    manager = ModelManager()
    watcher = ModelWatcher(runtime, manager, RouterConfig(
        mode=cfg.router_mode, kv_overlap_score_weight=cfg.kv_overlap_score_weight,
        router_temperature=cfg.router_temperature, use_kv_events=cfg.use_kv_events,
    ), metrics=metrics)
    try:
        await watcher.start()
    except BaseException:
        await runtime.close()
        raise
    return runtime, manager, watcher
