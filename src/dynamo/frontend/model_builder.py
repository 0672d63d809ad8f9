"""Building a served model from a worker's model entry (``out=dyn``): its client, router and pipeline.

The discovery watch loop (discovery.py) decides *when* a model appears, grows or goes; this module
decides *what* serves it.  Backend models get our pre/post-processing with the card's tokenizer and
template in front of a :class:`RemoteCoreEngine` (routing, migration), wrapped for disaggregation
(frontend/disagg.py: prefill workers first when there are any); Chat/Completion models are forwarded
(:class:`RemoteChatEngine`); Embedding models go through :class:`RemoteEmbeddingEngine`.  One client per
endpoint is made and kept here, shared by every model registered on it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from dynamo.disagg.plan import DisaggStats
from dynamo.frontend.disagg import DisaggCoreEngine
from dynamo.frontend.model_client import ModelClient
from dynamo.frontend.model_metrics import ModelLimits
from dynamo.frontend.remote import (
    QueuePolicy,
    RemoteChatEngine,
    RemoteCoreEngine,
    RouterConfig,
    RouterPolicy,
    SimpleRouter,
)
from dynamo.llm.model_entry import OBJECT_BUCKET, ModelEntry
from dynamo.llm.model_type import ModelType
from dynamo.llm.pipeline import CorePipeline, FullPipeline
from dynamo.llm.v1_card import load_entry_card

EndpointKey = tuple[str, str, str]  # (namespace, component, endpoint)


@dataclass
class RemoteModel:
    """What serves one model name: the client over its endpoints' instances, its router, and (prefill
    workers only) the engine over them."""

    name: str
    model_type: ModelType
    client: ModelClient
    endpoints: dict[EndpointKey, set[str]] = field(default_factory=dict)  # endpoint -> entry keys
    router: RouterPolicy | None = None
    engine: Any = None  # prefill entries: the RemoteCoreEngine over the prefill workers
    limits: ModelLimits = field(default_factory=ModelLimits)  # the model_* gauges (model_metrics.py)

    @property
    def entries(self) -> set[str]:
        return {key for keys in self.endpoints.values() for key in keys}


class ModelBuilder:
    """Makes served models from entries.

    ``prefill_engine(name)`` is the engine over a model's prefill workers (None while there are none),
    ``prefill_stats(name)`` what counts where its prompts were prefilled (None without metrics): the
    prefill pool's (prefill_pool.py).  ``observer(name)`` the per-worker metrics of a model, or None;
    ``router_metrics(entry)`` a KV router's series (frontend/router_metrics.py), or None.
    """

    def __init__(self, runtime: Any, config: RouterConfig, *, prefill_engine: Callable[[str], Any],
                 prefill_stats: Callable[[str], Any], observer: Callable[[str], Any],
                 router_metrics: Callable[[ModelEntry], Any] | None = None):
        self.runtime = runtime
        self.config = config
        self.clients: dict[EndpointKey, Any] = {}  # one runtime client per endpoint
        self._prefill_engine = prefill_engine
        self._prefill_stats = prefill_stats
        self._observer = observer
        self._router_metrics = router_metrics  # a KV router's series on /metrics (router_metrics.py), or None
        # base model name -> its KV router, whose bookings its LoRA adapters' routers share (kv/router.py)
        self._base_kv_routers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    async def client_for(self, ep_key: EndpointKey) -> Any:
        client = self.clients.get(ep_key)
        if client is None:
            ns, comp, ep = ep_key
            client = await self.runtime.namespace(ns).component(comp).endpoint(ep).client()
            self.clients[ep_key] = client
        return client

    async def build(self, key: str, entry: ModelEntry, ep_key: EndpointKey) -> tuple[RemoteModel, Any] | None:
        """The served model and its pipeline for the first entry of a name; None for a model type this
        frontend does not serve."""
        client = ModelClient([await self.client_for(ep_key)])
        card = await load_entry_card(self.runtime.object_store(OBJECT_BUCKET), entry.card)
        observer = self._observer(entry.name)  # per-worker timing and migration counts on /metrics
        card.display_name = entry.name
        served = RemoteModel(entry.name, entry.model_type, client, {ep_key: {key}},
                             limits=ModelLimits.of(card, entry.runtime_config))
        cfg = self.config
        if entry.model_type is ModelType.Backend:
            served.router = await self.make_router(entry, card, client, shares_load=True)
            engine: Any = RemoteCoreEngine(client, served.router, queue=cfg.queue,
                                           migration_limit=max(card.migration_limit, cfg.migration_limit),
                                           observer=observer)
            name = entry.name
            engine = DisaggCoreEngine(engine, lambda: self._prefill_engine(name),
                                      max_local_prefill_length=cfg.max_local_prefill_length,
                                      stats=DisaggStats(self._prefill_stats(entry.name)))
            model: Any = CorePipeline(entry.name, card, engine)
        elif entry.model_type in (ModelType.Chat, ModelType.Completion):
            chat_engine: Any = RemoteChatEngine(client, cfg.queue, observer=observer)
            model = FullPipeline(entry.name, card, chat_engine)
        elif entry.model_type is ModelType.Embedding:
            from dynamo.frontend.remote_embeddings import RemoteEmbeddingEngine
            from dynamo.llm.embeddings import EmbeddingModel
            from dynamo.llm.tokenizer import Tokenizer

            tokenizer = Tokenizer(card.tokenizer_json) if card.has_tokenizer else None  # type: ignore[arg-type]
            # token_ids on the wire, as the original's embedding workers take them
            engine = RemoteEmbeddingEngine(client, entry.name, tokenizer, queue=cfg.queue)
            model = EmbeddingModel(entry.name, card, engine, tokenizer=tokenizer)
        else:
            return None
        return served, model

    async def build_prefill(self, key: str, entry: ModelEntry, ep_key: EndpointKey) -> RemoteModel:
        """A model's first prefill worker: its own client and router (KV-aware under kv mode)."""
        client = ModelClient([await self.client_for(ep_key)])
        card = await load_entry_card(self.runtime.object_store(OBJECT_BUCKET), entry.card)
        served = RemoteModel(entry.name, entry.model_type, client, {ep_key: {key}})
        served.router = await self.make_router(entry, card, client)
        # no migration and no waiting for a prefill: when it fails or every prefill worker is full, the
        # decode worker prefills locally at once (a 503 here is a fallback, not an error for the client)
        served.engine = RemoteCoreEngine(client, served.router, migration_limit=0, queue=QueuePolicy(size=0, timeout=0.0))
        return served

    async def join(self, served: RemoteModel, key: str, entry: ModelEntry, ep_key: EndpointKey) -> bool:
        """Another entry of a served model; whether it brought an endpoint the model was not served by."""
        new = ep_key not in served.endpoints
        if new:
            served.client.add(await self.client_for(ep_key))
            await self._extend_router(served, entry)
        served.endpoints.setdefault(ep_key, set()).add(key)
        return new

    async def make_router(self, entry: ModelEntry, card: Any, client: Any, *, shares_load: bool = False
                          ) -> RouterPolicy:
        """``shares_load``: a decode model's router, whose bookings per worker a LoRA adapter shares with
        its base model (the same workers: one load, whatever model a request names)."""
        cfg = self.config
        if cfg.mode != "kv":
            return SimpleRouter("random" if cfg.mode == "random" else "round-robin")
        from dynamo.frontend.kv_policy import make_kv_router

        base = (card.lora or {}).get("base_model") if shares_load else None
        load_of = self._base_kv_routers.get(base) if isinstance(base, str) else None
        metrics = self._router_metrics(entry) if self._router_metrics is not None else None
        policy = await make_kv_router(self.runtime, entry, card, client, cfg, load_of=load_of, metrics=metrics)
        if shares_load and card.lora is None:
            self._base_kv_routers[entry.name] = policy.router
        return policy

    async def _extend_router(self, served: RemoteModel, entry: ModelEntry) -> None:
        """A KV router also follows the bookings of the routers of another component serving the model."""
        if served.router is None:
            return
        if any(ns == entry.namespace and comp == entry.component for ns, comp, _ in served.endpoints):
            return
        await served.router.follow_component(entry.namespace, entry.component, entry.endpoint)


def worker_added(router: RouterPolicy | None, entry: ModelEntry) -> None:
    if router is not None:
        router.add_worker(entry)  # KV routers ask a new worker what it caches
