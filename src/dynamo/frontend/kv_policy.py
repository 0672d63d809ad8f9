"""``--router-mode kv`` on the frontend: a :class:`KvRouter` (:mod:`dynamo.kv`) per model, fed by the
event plane (:mod:`dynamo.runtime.event_plane`), in Dynamo 1.x's shapes and envelopes.

Workers, ours and 1.x's alike, publish KV events (blocks stored/removed) as topic ``kv-events`` of their
serving endpoint (:mod:`dynamo.kv.v1_events`); the router follows that topic for each endpoint of its
workers and keeps its radix tree from it (or, with ``--use-kv-events false``, predicts the cache from its
own decisions).  Every decision is published as topic ``kv-hit-rate`` (which 1.x has no reader for), and
frontends share their in-flight bookkeeping as topic ``active_sequences_events`` (both in the endpoint's
scope) so several frontends in front of the same workers see each other's load and do not pile onto one
worker.

The indexer follows KV events only if the model's workers say they publish them (our workers'
``runtime_config.publishes_kv_events``, 1.x's ``kv_event_publishing_enabled``); otherwise, or with
``--use-kv-events false``, the router predicts the cache from its own decisions (approximate indexer),
and says once per model which it does.  With KV events, every worker that appears (and every worker
after the event plane reconnected, when events may have been lost) is asked for the blocks it holds on
the recovery endpoint its ``EventSource`` record names (``worker_kv_query_source_*``), so a frontend
that starts next to busy workers is not blind.  The bookings travel in Dynamo 1.6.1's shape, so our routers and
1.6.1's (``--router-replica-sync``) share them both ways (kv/replica_sync.py).  Each router of ours sends a
heartbeat with its in-flight requests every ``DYN_ROUTER_PEER_TTL / 3`` seconds; a peer's bookings expire when its
heartbeats stop (router.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import weakref
from typing import TYPE_CHECKING, Any

import orjson

from dynamo.bounds import track
from dynamo.frontend.remote import RouterConfig
from dynamo.kv import ApproxKvIndexer, KvRouter, replica_sync
from dynamo.kv.decision_log import DecisionLog
from dynamo.kv.events import EventError
from dynamo.kv.hashing import MASK64, compute_hashes_async
from dynamo.kv.router import DEFAULT_PEER_TTL_S, DEFAULT_PREFIX_FETCH_WEIGHT
from dynamo.kv.v1_events import (
    TOPIC_ACTIVE_SEQUENCES,
    TOPIC_HIT_RATE,
    TOPIC_KV_EVENTS,
    decode_payload,
    decode_router_events,
    dump_from_tree,
    encode_payload,
    recovery_query,
)
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_entry import (
    KV_PREFIX_SHARE,
    PUBLISHES_KV_EVENTS,
    SUGGESTED_OVERLAP_WEIGHT,
    V1_PUBLISHES_KV_EVENTS,
    ModelEntry,
    is_1x_worker,
)
from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.llm.protocols.wire import PeerRequest
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.event_plane import EventPlane, EventPublisher, EventSubscription
from dynamo.runtime.v1_event_wire import EVENT_SOURCES, EndpointScope, Envelope
from dynamo.runtime.v1_records import signed_id

if TYPE_CHECKING:
    from dynamo.frontend.router_metrics import BoundRouterMetrics

log = logging.getLogger(__name__)

HASH_OFF_LOOP_TOKENS = 8192  # prompts this long are hashed in slices before the decision (prepare)
KV_STATE_TIMEOUT_S = 5.0
RECONNECT_CHECK_S = 0.5


def peer_ttl() -> float:
    """Seconds of silence after which a peer router's bookings are dropped (``DYN_ROUTER_PEER_TTL``)."""
    raw = os.environ.get("DYN_ROUTER_PEER_TTL")
    try:
        return float(raw) if raw else DEFAULT_PEER_TTL_S
    except ValueError:
        log.warning("DYN_ROUTER_PEER_TTL=%r is not a number; using %.0f s", raw, DEFAULT_PEER_TTL_S)
        return DEFAULT_PEER_TTL_S


def prefix_homes() -> bool:
    """``DYN_ROUTER_PREFIX_HOMES=0`` turns off the tie-break by where a prefix was last routed (kv/homes.py),
    for comparisons; anything but 0/false/off/no (or unset) keeps it on."""
    raw = os.environ.get("DYN_ROUTER_PREFIX_HOMES", "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    log.warning("DYN_ROUTER_PREFIX_HOMES=%r is not a boolean; keeping it on", raw)
    return True


def prefix_fetch_weight() -> float:
    """``DYN_ROUTER_PREFIX_FETCH_WEIGHT`` (0..1, default 0.9): what a block the chosen worker can fetch from
    another worker (disagg/prefix_share.py) saves of a resident block's prefill; 0 never names a source,
    even between workers that lend (llamacpp workers, where ``DYN_KV_PREFIX_SHARING`` allows)."""
    raw = os.environ.get("DYN_ROUTER_PREFIX_FETCH_WEIGHT", "").strip()
    if not raw:
        return DEFAULT_PREFIX_FETCH_WEIGHT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        log.warning("DYN_ROUTER_PREFIX_FETCH_WEIGHT=%r is not a number from 0 to 1; keeping %g", raw,
                    DEFAULT_PREFIX_FETCH_WEIGHT)
        return DEFAULT_PREFIX_FETCH_WEIGHT
    return value


# the overlap weight when neither the operator (--kv-overlap-score-weight) nor the workers' engine says one;
# the original's is 1.0 (docs/routing.md, "Choosing the default overlap weight": measured on mocker fleets)
DEFAULT_OVERLAP_WEIGHT = 2.0


def overlap_weight(cfg: RouterConfig, entry: Any) -> tuple[float, str]:
    """The KV router's overlap weight for a model, and where it came from.

    The weight says how many blocks of decode load one block of prefill is worth, and that ratio is the
    engine's: on llama.cpp on a CPU a prefill block costs tens of milliseconds while a neighbour's decode
    load hardly slows a new request's first token, so the weight chosen on simulated GPU engines made the
    router leave a busy worker holding a conversation's history to compute it again on an idle one.  So
    an engine may suggest its own in its workers' ``runtime_config``; the operator's flag always wins."""
    if cfg.kv_overlap_score_weight is not None:
        return cfg.kv_overlap_score_weight, "--kv-overlap-score-weight"
    suggested = suggested_overlap_weight(entry)
    if suggested is None:
        return DEFAULT_OVERLAP_WEIGHT, "default"
    return suggested, "suggested by its workers' engine"


def suggested_overlap_weight(entry: Any) -> float | None:
    """The weight a worker's engine suggests; None when it suggests none, or something that is not a
    weight (logged)."""
    raw = (entry.runtime_config or {}).get(SUGGESTED_OVERLAP_WEIGHT)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        log.warning("model %s: its worker suggests overlap weight %r, not a number >= 0; using %g",
                    entry.name, raw, DEFAULT_OVERLAP_WEIGHT)
        return None
    return value


def publishes_kv_events(entry: Any) -> bool:
    rc = entry.runtime_config or {}
    return bool(rc.get(PUBLISHES_KV_EVENTS) or (is_1x_worker(entry) and rc.get(V1_PUBLISHES_KV_EVENTS)))


class KvRouterPolicy:
    def __init__(self, router: KvRouter, events: EventPlane | None, *, runtime: Any = None, events_requested: bool = True,
                 weight_from_workers: bool = False, metrics: BoundRouterMetrics | None = None):
        self.router = router
        self.metrics = metrics  # the router's series on /metrics (router_metrics.py), or None
        if metrics is not None:
            router.overhead = metrics.decision_overhead
        self.events_requested = events_requested  # --use-kv-events
        # the overlap weight is what the first worker's engine suggested (no --kv-overlap-score-weight)
        self.weight_from_workers = weight_from_workers
        self._weight_mismatch_logged = False
        self._events = events  # the runtime's event plane (None: a router fed by hand, in tests)
        self._runtime = runtime
        self._subs: list[EventSubscription] = []
        self._tracked: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers: dict[int, Any] = {}  # instance id -> its model entry
        self._kv_state_clients: dict[tuple[str, ...], Any] = {}  # (namespace, component, endpoint) -> client
        # the endpoints whose kv-events this router follows (None while its subscription is being made)
        self._kv_subs: dict[EndpointScope, EventSubscription | None] = {}
        self._timer: asyncio.Task[None] | None = None
        self._mismatch_logged = False
        # id(request) -> (its token ids, their block hashes), from prepare() for open()
        self._prepared: dict[int, tuple[Any, tuple[list[int], list[int]]]] = {}
        # per request, back to 0 when idle (the memory test checks: tests/integration/test_memory_bounded.py)
        track("kv_policy_tracked_requests", self, lambda p: len(p._tracked))
        track("kv_policy_prepared_hashes", self, lambda p: len(p._prepared))

    async def prepare(self, request: PreprocessedRequest) -> None:
        """Hash a long prompt before :meth:`open`, in slices that let the event loop run in between
        (a 128k-token prompt is about 6 ms of hashing; docs/routing.md)."""
        ids = request.token_ids
        if len(ids) < HASH_OFF_LOOP_TOKENS:
            return
        entry = self._prepared.get(id(request))
        if entry is not None and entry[0] is ids:
            return
        hashes = await compute_hashes_async(ids, self.router.block_size, lora_name=self.router.lora_name)
        self._prepared[id(request)] = (ids, hashes)

    def open(self, client: Any, request: PreprocessedRequest, rt_ctx: Any) -> Any:
        body_id = rt_ctx.id()
        entry = self._prepared.pop(id(request), None)
        hashes = entry[1] if entry is not None and entry[0] is request.token_ids else None
        request.prefix_source = None  # (a migration retry carries the last decision's: never reuse it)
        if request.backend_instance_id is not None:
            self.router.add_request(body_id, request.token_ids, request.backend_instance_id)
            self._tracked.add(body_id)
            return client.direct(PeerRequest(request), request.backend_instance_id, context=rt_ctx)
        if body_id in self._tracked:  # a migration retry: forget the previous choice first
            self.router.on_finished(body_id)
        # workers at their limit of requests in flight are left out (all of them only in a race)
        candidates = client.free_instance_ids() or client.instance_ids()
        decision = self.router.select(request.token_ids, candidates, request_id=body_id, hashes=hashes)
        self._tracked.add(body_id)
        if self.metrics is not None:
            n = len(request.token_ids)
            self.metrics.routed(body_id, n, decision.overlap_blocks, -(-n // self.router.block_size))
        request.estimated_prefix_hit_num_blocks = decision.overlap_blocks
        if decision.prefix_source is not None:
            request.prefix_source = {"address": decision.prefix_source[0], "tokens": decision.prefix_source[1]}
        log.debug("request %s -> worker %x (%d cached blocks)", body_id, decision.worker_id, decision.overlap_blocks)
        return client.direct(PeerRequest(request), decision.worker_id, context=rt_ctx)

    def first_token(self, request_id: str) -> None:
        self.router.on_first_token(request_id)
        if self.metrics is not None:
            self.metrics.first_token(request_id)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        self._tracked.discard(request_id)
        self.router.on_finished(request_id)
        if self.metrics is not None:
            self.metrics.finished(request_id, output_tokens)

    def remove_worker(self, worker_id: int) -> None:
        self._workers.pop(worker_id, None)
        self.router.remove_worker(worker_id)

    @property
    def kv_router(self) -> KvRouter:
        return self.router

    async def follow_component(self, namespace: str, component: str, endpoint: str) -> None:
        """Another component serves the model too: its routers' in-flight bookkeeping (its workers' KV
        events are followed as each worker appears)."""
        if not self.router.owns_load or self.router.publish_active_sequence is None:
            return  # the router whose bookings it shares follows the peers; or no replica sync
        await self.follow_bookings(EndpointScope(namespace, component, endpoint))

    async def follow_bookings(self, scope: EndpointScope) -> None:
        """The bookings of every other router in front of ``scope``'s workers: other processes' over the
        event plane, this process's other routers' handed over directly (the plane does not deliver a
        process's own events)."""
        if self._events is None:
            return
        in_process_routers(self._events, scope).append(self.router)
        await self.subscribe(scope, TOPIC_ACTIVE_SEQUENCES, self.router.apply_active_sequence_event)

    def add_worker(self, entry: Any) -> None:
        """A worker's model entry appeared: with KV events, ask it what it caches already."""
        events = not isinstance(self.router.indexer, ApproxKvIndexer)
        if publishes_kv_events(entry) != events and self.events_requested and not self._mismatch_logged:
            self._mismatch_logged = True
            log.warning("model %s: worker %x %s KV events but the router uses %s; all workers of a model "
                        "should run the same engine", entry.name, entry.instance_id,
                        "publishes" if publishes_kv_events(entry) else "does not publish",
                        "them" if events else "the approximate indexer")
        if entry.instance_id in self._workers:
            return
        self._workers[entry.instance_id] = entry
        if self.weight_from_workers and not self._weight_mismatch_logged:
            suggested = suggested_overlap_weight(entry)
            weight = DEFAULT_OVERLAP_WEIGHT if suggested is None else suggested
            if weight != self.router.overlap_score_weight:
                self._weight_mismatch_logged = True
                log.warning("model %s: worker %x's engine suggests overlap weight %g but the router weighs %g, as "
                            "its first worker's did; all workers of a model should run the same engine, or set "
                            "--kv-overlap-score-weight", entry.name, entry.instance_id, weight,
                            self.router.overlap_score_weight)
        lends = (entry.runtime_config or {}).get(KV_PREFIX_SHARE)
        if events and isinstance(lends, str) and lends:
            self.router.lenders[entry.instance_id] = lends
        if events and self._events is not None and publishes_kv_events(entry):
            self._spawn(self._follow(entry))

    def start(self) -> None:
        self._timer = asyncio.create_task(self._tick(), name="kv-router-timer")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resync(self, entry: Any) -> None:
        """Ask a worker for the blocks it holds (its recovery endpoint) and apply them."""
        worker_id = entry.instance_id
        self.router.begin_resync(worker_id)
        try:
            async with asyncio.timeout(KV_STATE_TIMEOUT_S):
                dump = await self._kv_state_of(entry)
                if dump is not None:
                    n = self.router.apply_dump(worker_id, dump)
                    log.info("KV state of worker %x: %d cached blocks", worker_id, n)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # gone, or an engine without recovery: its events will do
            log.info("KV state of worker %x not read: %s", worker_id, str(e) or type(e).__name__)
        finally:
            self.router.end_resync(worker_id)

    async def _follow(self, entry: Any) -> None:
        """Follow a worker's endpoint's ``kv-events`` (once per endpoint), then ask the worker for what it
        holds, in that order so that nothing falls between the answer and the stream."""
        scope = EndpointScope(entry.namespace, entry.component, entry.endpoint)
        if scope not in self._kv_subs:
            assert self._events is not None
            self._kv_subs[scope] = None  # taken: a second worker of this endpoint does not subscribe again
            try:
                self._kv_subs[scope] = await self._events.subscribe(scope, TOPIC_KV_EVENTS, self._apply_events)
            except Exception:
                self._kv_subs.pop(scope, None)
                raise
        await self._resync(entry)

    def _apply_events(self, env: Envelope) -> None:
        try:
            events = decode_router_events(env.payload)
        except EventError as e:
            log.warning("undecodable KV events skipped: %s", e)
            return
        for event in events:
            worker = event.get("worker_id")
            if isinstance(worker, int):  # unsigned on the wire; ids above i64's maximum are negative here
                event["worker_id"] = signed_id(worker)
            self.router.apply_event(event)

    async def _recovery_endpoint(self, entry: Any) -> str:
        """The recovery endpoint a worker's ``EventSource`` record names (waits for the record)."""
        prefix = EndpointScope(entry.namespace, entry.component, entry.endpoint).key_prefix(EVENT_SOURCES,
                                                                                           TOPIC_KV_EVENTS)
        while True:
            for kv in await self._runtime.discovery().get_prefix(prefix):
                try:
                    meta = orjson.loads(kv.value)["metadata"]
                    if meta["worker"]["worker_id"] == entry.instance_id & MASK64:
                        return str(meta["recovery_target"]["endpoint"])
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
            await asyncio.sleep(0.1)

    async def _kv_state_of(self, entry: Any) -> dict[str, Any] | None:
        """What a worker holds, in our dump's shape: its answer to a recovery query (a ``TreeDump``) on the
        endpoint its ``EventSource`` record names."""
        worker_id = entry.instance_id
        name = await self._recovery_endpoint(entry)
        key = (entry.namespace, entry.component, name)
        client = self._kv_state_clients.get(key)
        if client is None:
            endpoint = self._runtime.namespace(key[0]).component(key[1]).endpoint(name)
            client = self._kv_state_clients[key] = await endpoint.client()
        while worker_id not in client.instance_ids():  # noqa: ASYNC110 - the client has no per-id event
            await asyncio.sleep(0.05)
        async for answer in client.direct(recovery_query(worker_id & MASK64), worker_id):
            return dump_from_tree(worker_id, answer)
        return None

    async def _tick(self) -> None:
        """Heartbeats to peer routers, their expiry, and a resync of every worker after the event plane
        reconnected (or connected to a new publisher)."""
        interval = self.router.peer_ttl / 3
        loop = asyncio.get_running_loop()
        next_beat = 0.0
        reconnects = self._reconnects()
        while True:
            now = loop.time()
            if now >= next_beat:
                next_beat = now + interval
                self.router.heartbeat()
                self.router.expire_peers()
            if self.router.decision_log is not None:
                self.router.decision_log.flush()
            seen = self._reconnects()
            if seen != reconnects:
                reconnects = seen
                if not isinstance(self.router.indexer, ApproxKvIndexer):
                    log.info("event plane reconnected: asking %d worker(s) for their KV state again", len(self._workers))
                    for entry in list(self._workers.values()):
                        if publishes_kv_events(entry):
                            self._spawn(self._resync(entry))
            await asyncio.sleep(min(RECONNECT_CHECK_S, max(0.0, next_beat - loop.time())))

    def _reconnects(self) -> int:
        return self._events.reconnects if self._events is not None else 0

    async def subscribe(self, scope: EndpointScope, topic: str, handler: Any) -> None:
        """Hand each event of ``topic`` in ``scope`` (a MessagePack map) to ``handler``."""
        if self._events is None:
            return

        def on_event(env: Envelope) -> None:
            try:
                handler(decode_payload(env.payload))
            except EventError as e:
                log.debug("undecodable %s event skipped: %s", topic, e)

        self._subs.append(await self._events.subscribe(scope, topic, on_event))

    async def close(self) -> None:
        if self._events is not None:
            for routers in _in_process.get(self._events, {}).values():
                while self.router in routers:
                    routers.remove(self.router)
        tasks = [t for t in (self._timer, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._timer = None
        for client in self._kv_state_clients.values():
            try:
                await client.close()
            except Exception:
                pass
        self._kv_state_clients.clear()
        if self.router.decision_log is not None:
            self.router.decision_log.close()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                pass
        self._subs.clear()
        for kv_sub in self._kv_subs.values():
            if kv_sub is not None:
                try:
                    await kv_sub.unsubscribe()
                except Exception:
                    pass
        self._kv_subs.clear()


_publishers: "weakref.WeakKeyDictionary[Any, dict[tuple[EndpointScope, str], EventPublisher]]" = \
    weakref.WeakKeyDictionary()


_in_process: "weakref.WeakKeyDictionary[Any, dict[EndpointScope, list[KvRouter]]]" = weakref.WeakKeyDictionary()


def in_process_routers(plane: EventPlane, scope: EndpointScope) -> list[KvRouter]:
    """This process's routers that follow the bookings in front of ``scope``'s workers."""
    return _in_process.setdefault(plane, {}).setdefault(scope, [])


async def shared_publisher(plane: EventPlane, scope: EndpointScope, topic: str) -> EventPublisher:
    """One publisher of ``topic`` in ``scope`` per event plane, whichever router publishes: the KV routers of a
    model's LoRA adapters (one each, on their base model's workers) share a stream instead of binding a
    socket apiece."""
    mine = _publishers.setdefault(plane, {})
    pub = mine.get((scope, topic))
    if pub is None:
        pub = mine[(scope, topic)] = await plane.publisher(scope, topic)
    return pub


async def bookings_publisher(plane: EventPlane, scope: EndpointScope) -> Any:
    """What a KV router publishes its bookings with (replica sync): to the routers of other processes over
    the event plane, and to this process's other routers in front of ``scope`` directly."""
    pub = await shared_publisher(plane, scope, TOPIC_ACTIVE_SEQUENCES)
    here = in_process_routers(plane, scope)
    transport = pub.transport

    def publish(event: dict[str, Any]) -> Any:
        for other in here:
            if other.router_id != event["router_id"]:  # (not back to its sender, nor to a router sharing its id)
                other.apply_active_sequence_event(event)
        return pub.publish(encode_payload(replica_sync.frame(event, transport)))
    return publish


async def make_kv_router(runtime: DistributedRuntime, entry: ModelEntry, card: ModelCard, client: Any,
                         cfg: RouterConfig, *, load_of: KvRouter | None = None,
                         metrics: BoundRouterMetrics | None = None) -> KvRouterPolicy:
    """``load_of``: the router whose bookings this one shares (a LoRA adapter's base model's, router.py),
    so that a worker's load is one figure whatever model its requests name; the peers' bookings reach
    both through that router's subscription."""
    plane = runtime.event_plane()
    scope = EndpointScope(entry.namespace, entry.component, entry.endpoint)

    async def publisher(topic: str) -> Any:
        if plane is None:
            return None
        pub = await shared_publisher(plane, scope, topic)
        return lambda event: pub.publish(encode_payload(event))

    events = cfg.use_kv_events and publishes_kv_events(entry)
    # an adapter's router shares its base model's bookings, so it must weigh them alike
    weight, weight_from = ((load_of.overlap_score_weight, "its base model's") if load_of is not None
                           else overlap_weight(cfg, entry))
    router = KvRouter(
        block_size=card.kv_cache_block_size,
        overlap_score_weight=weight,
        temperature=cfg.router_temperature,
        use_kv_events=events,
        publish_hit_rate=await publisher(TOPIC_HIT_RATE),
        publish_active_sequence=(await bookings_publisher(plane, scope)
                                 if cfg.router_replica_sync and plane is not None else None),
        peer_ttl=peer_ttl(),
        decision_log=DecisionLog.from_env(),
        lora_name=card.lora_name,
        load_of=load_of,
        prefix_homes=prefix_homes(),
        prefix_fetch_weight=prefix_fetch_weight(),
    )
    if router.decision_log is not None:
        log.info("KV router for %s: logging every decision to %s", entry.name, router.decision_log.path)
    policy = KvRouterPolicy(router, plane, runtime=runtime, events_requested=cfg.use_kv_events,
                            weight_from_workers=load_of is None and cfg.kv_overlap_score_weight is None,
                            metrics=metrics)
    if load_of is None and cfg.router_replica_sync:
        await policy.follow_bookings(scope)
    if events:
        how = "KV events"
    elif not cfg.use_kv_events:
        how = "approximate indexer (--use-kv-events false)"
    else:
        how = "approximate indexer (its workers do not publish KV events)"
    if card.lora_name:
        how += f", LoRA adapter {card.lora_name} (its own block hashes"
        how += ", its base model's load per worker)" if load_of is not None else ")"
    log.info("KV router for %s: block size %d, overlap weight %.2f (%s), temperature %.2f, %s",
             entry.name, card.kv_cache_block_size, weight, weight_from, cfg.router_temperature, how)
    policy.start()
    return policy

