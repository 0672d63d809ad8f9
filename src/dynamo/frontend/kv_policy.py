"""``--router-mode kv`` on the frontend: a :class:`KvRouter` (:mod:`dynamo.kv`) per model, fed over NATS.

Workers publish KV events (blocks stored/removed) on ``namespace.<ns>.component.<comp>.kv_events``; the
router keeps its radix tree from them (or, with ``--use-kv-events false``, predicts the cache from its
own decisions).  Every decision is published on ``namespace.<ns>.kv-hit-rate``.  Frontends share their
in-flight bookkeeping on ``...component.<comp>.active_sequences_events`` so several frontends in front
of the same workers see each other's load and do not pile onto one worker.

The indexer follows KV events only if the model's workers say they publish them
(``runtime_config.publishes_kv_events`` in their model entries); otherwise, or with
``--use-kv-events false``, the router predicts the cache from its own decisions (approximate indexer),
and says once per model which it does.  With KV events, every worker that appears (and every worker
after a NATS reconnect, when events may have been lost) is asked for the blocks it holds, on its
``kv_state`` endpoint, so a frontend that starts next to busy workers is not blind.  Each router sends a
heartbeat with its in-flight requests every ``DYN_ROUTER_PEER_TTL / 3`` seconds; a peer's bookings
expire when its heartbeats stop (router.py).

**Dynamo 1.x workers** (a 1.6.1 mocker or vLLM worker in the same fleet: ``is_1x_worker``, their card says
``kv_event_publishing_enabled``) publish only in 1.x's form: for each of their endpoints the router follows
``kv-events`` on 1.x's event plane (dynamo/kv/v1_events.py) and recovers each such worker through the
endpoint its ``EventSource`` record names (``worker_kv_query_source_*``) instead of ``kv_state``.  1.x
events are applied for 1.x workers only: our workers publish both forms, and their own is the one this
router numbers and recovers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import orjson

from dynamo.bounds import track
from dynamo.frontend.remote import RouterConfig
from dynamo.kv import ApproxKvIndexer, KvRouter
from dynamo.kv.decision_log import DecisionLog
from dynamo.kv.events import KV_STATE_ENDPOINT, EventError
from dynamo.kv.hashing import MASK64, compute_hashes_async
from dynamo.kv.router import DEFAULT_PEER_TTL_S, DEFAULT_PREFIX_FETCH_WEIGHT
from dynamo.kv.v1_events import TOPIC_KV_EVENTS, decode_router_events, dump_from_tree, recovery_query
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
from dynamo.runtime.names import component_event_subject, namespace_event_subject
from dynamo.runtime.v1_event_wire import EVENT_SOURCES, EndpointScope, Envelope

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
    def __init__(self, router: KvRouter, events: Any, *, runtime: Any = None, events_requested: bool = True,
                 weight_from_workers: bool = False, metrics: BoundRouterMetrics | None = None):
        self.router = router
        self.metrics = metrics  # the router's series on /metrics (router_metrics.py), or None
        if metrics is not None:
            router.overhead = metrics.decision_overhead
        self.events_requested = events_requested  # --use-kv-events
        # the overlap weight is what the first worker's engine suggested (no --kv-overlap-score-weight)
        self.weight_from_workers = weight_from_workers
        self._weight_mismatch_logged = False
        self._events = events  # the runtime's event plane (runtime/event_plane.py)
        self._runtime = runtime
        self._subs: list[Any] = []
        self._tracked: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers: dict[int, Any] = {}  # instance id -> its model entry
        self._kv_state_clients: dict[tuple[str, ...], Any] = {}  # (namespace, component[, endpoint]) -> client
        # Dynamo 1.x workers, whose 1.x events are applied: their id as 1.x sends it (u64) -> as we keep it
        self._v1_workers: dict[int, int] = {}
        self._v1_subs: dict[EndpointScope, Any] = {}  # their endpoints' kv-events, followed
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
        self._v1_workers.pop(worker_id & MASK64, None)
        self.router.remove_worker(worker_id)

    @property
    def kv_router(self) -> KvRouter:
        return self.router

    async def follow_component(self, namespace: str, component: str) -> None:
        """Another component serves the model too: its workers' KV events (unless the router predicts the
        cache itself) and its routers' in-flight bookkeeping."""
        if self.router.use_kv_events:
            await self.subscribe(component_event_subject(namespace, component, "kv_events"), self.router.apply_event)
        if not self.router.owns_load or self.router.publish_active_sequence is None:
            return  # the router whose bookings it shares follows the peers; or no replica sync
        await self.subscribe(component_event_subject(namespace, component, "active_sequences_events"),
                             self.router.apply_active_sequence_event)

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
        if events and self._runtime is not None and publishes_kv_events(entry):
            if is_1x_worker(entry):
                self._v1_workers[entry.instance_id & MASK64] = entry.instance_id
                self._spawn(self._follow_1x(entry))
            else:
                self._spawn(self._resync(entry))

    def start(self) -> None:
        self._timer = asyncio.create_task(self._tick(), name="kv-router-timer")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resync(self, entry: Any) -> None:
        """Ask a worker for the blocks it holds (its ``kv_state`` endpoint) and apply them."""
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
        except Exception as e:  # gone, or an engine without the query: its events will do
            log.info("KV state of worker %x not read: %s", worker_id, str(e) or type(e).__name__)
        finally:
            self.router.end_resync(worker_id)

    async def _follow_1x(self, entry: Any) -> None:
        """A Dynamo 1.x worker: follow its endpoint's 1.x ``kv-events`` (once per endpoint), then ask it for
        what it holds, in that order so that nothing falls between the answer and the stream."""
        scope = EndpointScope(entry.namespace, entry.component, entry.endpoint)
        if scope not in self._v1_subs:
            plane = self._runtime.v1_event_plane()
            if plane is None:
                log.warning("model %s: worker %x publishes its KV events in Dynamo 1.x's form only and this "
                            "process has no 1.x event plane (a fleet secret, or a static runtime): it is routed "
                            "on load alone", entry.name, entry.instance_id)
                return
            self._v1_subs[scope] = None  # taken: a second worker of this endpoint does not subscribe again
            try:
                self._v1_subs[scope] = await plane.subscribe(scope, TOPIC_KV_EVENTS, self._apply_1x)
            except Exception:
                self._v1_subs.pop(scope, None)
                raise
        await self._resync(entry)

    def _apply_1x(self, env: Envelope) -> None:
        try:
            events = decode_router_events(env.payload)
        except EventError as e:
            log.warning("undecodable 1.x KV events skipped: %s", e)
            return
        workers = self._v1_workers
        for event in events:
            worker = event.get("worker_id")
            ours = workers.get(worker) if isinstance(worker, int) else None
            if ours is not None:  # ids above i64's maximum are negative here, unsigned on 1.x's wire
                event["worker_id"] = ours
                self.router.apply_event(event)

    async def _recovery_endpoint(self, entry: Any) -> str:
        """The recovery endpoint a 1.x worker's ``EventSource`` record names (waits for the record)."""
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
        """What a worker holds, in our dump's shape: ours answer ``kv_state``; 1.x workers a recovery query
        on the endpoint their ``EventSource`` record names, with a ``TreeDump``."""
        worker_id = entry.instance_id
        v1 = is_1x_worker(entry)
        name = await self._recovery_endpoint(entry) if v1 else KV_STATE_ENDPOINT
        key = (entry.namespace, entry.component, name)
        client = self._kv_state_clients.get(key)
        if client is None:
            endpoint = self._runtime.namespace(key[0]).component(key[1]).endpoint(name)
            client = self._kv_state_clients[key] = await endpoint.client()
        while worker_id not in client.instance_ids():  # noqa: ASYNC110 - the client has no per-id event
            await asyncio.sleep(0.05)
        async for answer in client.direct(recovery_query(worker_id & MASK64) if v1 else {}, worker_id):
            return dump_from_tree(worker_id, answer) if v1 else answer
        return None

    async def _tick(self) -> None:
        """Heartbeats to peer routers, their expiry, and a resync of every worker after a NATS reconnect."""
        interval = self.router.peer_ttl / 3
        loop = asyncio.get_running_loop()
        next_beat = 0.0
        reconnects = _reconnects(self._events) + _reconnects(self._v1_plane())
        while True:
            now = loop.time()
            if now >= next_beat:
                next_beat = now + interval
                self.router.heartbeat()
                self.router.expire_peers()
            if self.router.decision_log is not None:
                self.router.decision_log.flush()
            seen = _reconnects(self._events) + _reconnects(self._v1_plane())
            if seen != reconnects:
                reconnects = seen
                if not isinstance(self.router.indexer, ApproxKvIndexer):
                    log.info("NATS reconnected: asking %d worker(s) for their KV state again", len(self._workers))
                    for entry in list(self._workers.values()):
                        if publishes_kv_events(entry):
                            self._spawn(self._resync(entry))
            await asyncio.sleep(min(RECONNECT_CHECK_S, max(0.0, next_beat - loop.time())))

    async def subscribe(self, subject: str, handler: Any) -> None:
        async def cb(_subject: str, payload: bytes) -> None:
            handler(payload)

        self._subs.append(await self._events.subscribe(subject, cb))

    async def close(self) -> None:
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
        for v1 in self._v1_subs.values():
            if v1 is not None:
                try:
                    await v1.unsubscribe()
                except Exception:
                    pass
        self._v1_subs.clear()

    def _v1_plane(self) -> Any:
        """The 1.x event plane if this router follows a 1.x worker (else None: nothing opened for it)."""
        if not self._v1_subs:
            return None
        return self._runtime.v1_event_plane()


async def make_kv_router(runtime: DistributedRuntime, entry: ModelEntry, card: ModelCard, client: Any,
                         cfg: RouterConfig, *, load_of: KvRouter | None = None,
                         metrics: BoundRouterMetrics | None = None) -> KvRouterPolicy:
    """``load_of``: the router whose bookings this one shares (a LoRA adapter's base model's, router.py),
    so that a worker's load is one figure whatever model its requests name; the peers' bookings reach
    both through that router's subscription."""
    plane = runtime.event_plane()

    def publisher(subject: str):
        def publish(event: dict[str, Any]) -> Any:
            return plane.publish(subject, orjson.dumps(event))
        return publish

    events = cfg.use_kv_events and publishes_kv_events(entry)
    # an adapter's router shares its base model's bookings, so it must weigh them alike
    weight, weight_from = ((load_of.overlap_score_weight, "its base model's") if load_of is not None
                           else overlap_weight(cfg, entry))
    router = KvRouter(
        block_size=card.kv_cache_block_size,
        overlap_score_weight=weight,
        temperature=cfg.router_temperature,
        use_kv_events=events,
        publish_hit_rate=publisher(namespace_event_subject(entry.namespace, "kv-hit-rate")),
        publish_active_sequence=publisher(
            component_event_subject(entry.namespace, entry.component, "active_sequences_events"))
        if cfg.router_replica_sync else None,
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
    if events:
        await policy.subscribe(component_event_subject(entry.namespace, entry.component, "kv_events"),
                               router.apply_event)
    if load_of is None and cfg.router_replica_sync:
        await policy.subscribe(component_event_subject(entry.namespace, entry.component, "active_sequences_events"),
                               router.apply_active_sequence_event)
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


def _reconnects(events: Any) -> int:
    return int(getattr(events, "reconnects", 0) or 0)
