"""Per-worker load on the frontend's ``/metrics``: the workers' ForwardPassMetrics as Prometheus gauges.

Workers that report their load (the mocker) publish it whenever their KV usage or queue changes, as
topic ``kv_metrics`` of their endpoint on the event plane (1.x's ActiveLoad, with our whole report in
``forward_pass_metrics``: :func:`dynamo.kv.v1_events.active_load`), and answer the same metrics on their
``load_metrics`` endpoint.  For every endpoint of a discovered worker the frontend follows that topic; when
a worker is discovered it also asks its ``load_metrics`` endpoint once, so an idle worker shows up before
it publishes anything.  Gauges (labels ``model``, lowercased as on
every frontend metric, ``worker_id`` in decimal, ``dp_rank``, ``worker_type`` = ``decode``), with the frontend's
metric prefix (every one in docs/metrics.md; the planner reads them per model)::

    <prefix>_worker_kv_total_blocks         kv_stats.kv_total_blocks
    <prefix>_worker_kv_cache_usage_ratio    kv_stats.gpu_cache_usage_perc (0..1)
    <prefix>_worker_prefix_cache_hit_rate   kv_stats.gpu_prefix_cache_hit_rate (0..1)
    <prefix>_worker_requests_waiting        worker_stats.num_requests_waiting
    <prefix>_worker_request_active_slots    worker_stats.request_active_slots
    <prefix>_worker_request_total_slots     worker_stats.request_total_slots

Dynamo 1.x's per-worker names and labels (``worker_id``, ``dp_rank``, ``worker_type``: no ``model``, a
worker serving several models has one series), so its dashboards work: ``<prefix>_worker_active_decode_blocks`` and
``<prefix>_worker_active_prefill_tokens`` are, as in Dynamo, the KV router's own count of what it sent
to each worker (read at scrape time); without a KV router the decode blocks are the worker's published
``kv_stats.kv_active_blocks``.  ``<prefix>_worker_last_time_to_first_token_seconds``,
``..._last_input_sequence_tokens`` and ``..._last_inter_token_latency_seconds`` are the last request
each worker served, set once per request by :class:`ModelObserver` (which also counts migrations).

``<prefix>_router_queue_pending_requests`` (:class:`QueueCollector`) counts the requests waiting because
every worker of their model is at its limit (``--queue-size``), read at scrape time.

Dynamo 1.x workers publish the same topic without our report: their ``kv_used_blocks`` is read as
``kv_stats.kv_active_blocks`` (:func:`dynamo.kv.v1_events.metrics_from_load`).

The flat [0.3] shape (all fields at the top level) is read too.  A worker's series disappear when its
model entry does (it stopped or died).  Messages from workers this frontend does not serve are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from dynamo.kv.events import EventError
from dynamo.kv.v1_events import TOPIC_KV_METRICS, metrics_from_load
from dynamo.runtime.v1_event_wire import EndpointScope, Envelope

log = logging.getLogger(__name__)

LOAD_METRICS_ENDPOINT = "load_metrics"

POLL_TIMEOUT_S = 2.0

LABELS = ["worker_id", "dp_rank", "worker_type"]  # Dynamo 1.6.1's
MODEL_LABELS = ["model", *LABELS]  # ours: the gauges of _FIELDS
WORKER_TYPE = "decode"  # aggregated serving: every worker is a decode worker, as Dynamo labels them

# gauge suffix, help, (section, field)
_FIELDS = (
    ("worker_kv_total_blocks", "KV cache blocks of a worker", ("kv_stats", "kv_total_blocks")),
    ("worker_kv_cache_usage_ratio", "Fraction of a worker's KV cache in use", ("kv_stats", "gpu_cache_usage_perc")),
    ("worker_prefix_cache_hit_rate", "A worker's recent prefix cache hit rate (cached / prompt blocks)",
     ("kv_stats", "gpu_prefix_cache_hit_rate")),
    ("worker_requests_waiting", "Requests waiting in a worker's queue", ("worker_stats", "num_requests_waiting")),
    ("worker_request_active_slots", "Requests running on a worker", ("worker_stats", "request_active_slots")),
    ("worker_request_total_slots", "Most requests a worker runs at once", ("worker_stats", "request_total_slots")),
)


class WorkerMetrics:
    """Follows the load metrics of the workers behind the frontend's models and exports them."""

    def __init__(self, runtime: Any, registry: CollectorRegistry, prefix: str,
                 kv_router_for: Callable[[str], Any] | None = None):
        self.runtime = runtime
        self.prefix = prefix
        self.gauges = [(Gauge(f"{prefix}_{suffix}", doc, MODEL_LABELS, registry=registry), path)
                       for suffix, doc, path in _FIELDS]
        self.last_ttft = Gauge(f"{prefix}_worker_last_time_to_first_token_seconds",
                               "Time to first token of the last request a worker served", LABELS, registry=registry)
        self.last_isl = Gauge(f"{prefix}_worker_last_input_sequence_tokens",
                              "Prompt tokens of the last request a worker served", LABELS, registry=registry)
        self.last_itl = Gauge(f"{prefix}_worker_last_inter_token_latency_seconds",
                              "Mean inter-token latency of the last request a worker served", LABELS, registry=registry)
        self._timing_gauges = (self.last_ttft, self.last_isl, self.last_itl)
        # model (lowercased) -> the KV router serving it (or None): the source of the active-load gauges
        self._kv_router_for = kv_router_for or (lambda model: None)
        self._published_active: dict[tuple[int, str], float] = {}  # (worker, dp rank) -> kv_active_blocks
        self._timed: set[int] = set()  # workers with timing series
        registry.register(_ActiveLoadCollector(self))
        self._models: dict[int, set[str]] = {}  # worker id -> models it serves (lowercased)
        self._ranks: dict[int, set[str]] = {}  # worker id -> dp ranks seen
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: dict[tuple[str, str], Any] = {}  # (namespace, component) -> load_metrics client
        self._subs: dict[EndpointScope, Any] = {}  # the workers' endpoints -> their kv_metrics, followed
        self._closed = False

    # -- discovery -----------------------------------------------------------------------------
    async def add_worker(self, namespace: str, component: str, worker_id: int, model: str, endpoint: str) -> None:
        """A worker serving ``model`` on ``endpoint`` was discovered: follow that endpoint's load."""
        if self._closed:
            return
        self._models.setdefault(worker_id, set()).add(model.lower())
        await self._follow(EndpointScope(namespace, component, endpoint))
        task = asyncio.create_task(self._poll(namespace, component, worker_id), name="load-metrics-poll")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, scope: EndpointScope) -> None:
        plane = self.runtime.event_plane()
        if plane is None or scope in self._subs:
            return

        def on_load(env: Envelope) -> None:
            try:
                self.apply(metrics_from_load(env.payload))
            except EventError as e:
                log.debug("bad kv_metrics message skipped: %s", e)

        self._subs[scope] = None  # taken: a second worker of this endpoint does not subscribe again
        try:
            self._subs[scope] = await plane.subscribe(scope, TOPIC_KV_METRICS, on_load)
        except Exception as e:  # metrics must never break discovery
            self._subs.pop(scope, None)
            log.warning("cannot follow the load of %s: %s", scope.subject_prefix, e)

    def remove_worker(self, worker_id: int, model: str | None = None) -> None:
        """The worker's entry for ``model`` (or for every model, with None) went away."""
        models = self._models.get(worker_id)
        if not models:
            return
        gone = set(models) if model is None else {model.lower()} & models
        wid = str(worker_id)
        for m in gone:
            for rank in self._ranks.get(worker_id, ()):
                for gauge, _ in self.gauges:
                    try:
                        gauge.remove(m, wid, rank, WORKER_TYPE)
                    except KeyError:
                        pass
        models -= gone
        if models:
            return  # it still serves another model: its 1.x series stay
        del self._models[worker_id]
        for rank in self._ranks.pop(worker_id, ()):
            self._published_active.pop((worker_id, rank), None)
        if worker_id in self._timed:
            self._timed.discard(worker_id)
            for gauge in self._timing_gauges:
                try:
                    gauge.remove(wid, "0", WORKER_TYPE)
                except KeyError:
                    pass

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs.values():
            try:
                if sub is not None:
                    await sub.unsubscribe()
            except Exception:  # the connection may be closed already
                pass
        self._subs.clear()
        for client in self._clients.values():
            try:
                await client.close()
            except Exception:
                pass
        self._clients.clear()

    # -- data ----------------------------------------------------------------------------------
    def apply(self, msg: dict[str, Any]) -> bool:
        """One load report (``{"worker_id", "data"}``); False if it was not usable or not about one of our
        workers."""
        try:
            worker_id = int(msg["worker_id"])
            data = msg["data"]
        except (KeyError, TypeError, ValueError) as e:
            log.debug("bad kv_metrics message skipped: %s", e)
            return False
        return self.set(worker_id, data)

    def set(self, worker_id: int, data: Any) -> bool:
        models = self._models.get(worker_id)
        if not models or not isinstance(data, dict):
            return False
        ws: dict[str, Any] = data["worker_stats"] if isinstance(data.get("worker_stats"), dict) else data
        rank = str(int(ws.get("data_parallel_rank") or 0))
        self._ranks.setdefault(worker_id, set()).add(rank)
        wid = str(worker_id)
        for gauge, (section, name) in self.gauges:
            part: dict[str, Any] = data[section] if isinstance(data.get(section), dict) else data
            value: Any = part.get(name)
            if _is_number(value):
                for m in models:
                    gauge.labels(m, wid, rank, WORKER_TYPE).set(value)
        kv_part = data.get("kv_stats")
        kv: dict[str, Any] = kv_part if isinstance(kv_part, dict) else data
        active = kv.get("kv_active_blocks")
        if isinstance(active, (int, float)) and not isinstance(active, bool):
            self._published_active[(worker_id, rank)] = float(active)
        return True

    def observer(self, model: str, migrations: "MigrationSink | None" = None) -> "ModelObserver":
        """What a model's engine reports per request: the worker's timing, and migrations."""
        return ModelObserver(self, model.lower(), migrations)

    def _active_load(self) -> Iterator[Metric]:
        decode = GaugeMetricFamily(f"{self.prefix}_worker_active_decode_blocks",
                                   "KV cache blocks of the requests in flight on a worker (the KV router's count; "
                                   "else the worker's own report)", labels=LABELS)
        prefill = GaugeMetricFamily(f"{self.prefix}_worker_active_prefill_tokens",
                                    "Prompt tokens still to prefill on a worker (the KV router's count)", labels=LABELS)
        for worker_id, models in list(self._models.items()):
            wid = str(worker_id)
            # the first KV router among its models: a LoRA adapter's router shares its base model's bookings,
            # so any one of them has the worker's whole load
            router = next((r for r in map(self._kv_router_for, sorted(models)) if r is not None), None)
            if router is not None:
                load = router.worker_load(worker_id)
                decode.add_metric([wid, "0", WORKER_TYPE], load["active_blocks"])
                prefill.add_metric([wid, "0", WORKER_TYPE], load["active_tokens"])
                continue
            for rank in self._ranks.get(worker_id, ()):
                value = self._published_active.get((worker_id, rank))
                if value is not None:
                    decode.add_metric([wid, rank, WORKER_TYPE], value)
        yield decode
        yield prefill

    async def _poll(self, namespace: str, component: str, worker_id: int) -> None:
        """Ask a newly discovered worker's ``load_metrics`` endpoint once (workers without one: nothing)."""
        try:
            async with asyncio.timeout(POLL_TIMEOUT_S):
                key = (namespace, component)
                client = self._clients.get(key)
                if client is None:
                    endpoint = self.runtime.namespace(namespace).component(component).endpoint(LOAD_METRICS_ENDPOINT)
                    client = self._clients[key] = await endpoint.client()
                while worker_id not in client.instance_ids():  # noqa: ASYNC110 - no per-id event; bounded by the timeout
                    await asyncio.sleep(0.05)
                async for item in client.direct({}, worker_id):
                    self.set(worker_id, item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no such endpoint, worker gone, timeout: the pushed metrics will do
            log.debug("load_metrics of worker %x not read: %s", worker_id, e or type(e).__name__)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _ActiveLoadCollector:
    """Reads the active-load gauges when /metrics is scraped (nothing to do per request)."""

    def __init__(self, owner: WorkerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        return self.owner._active_load()


class MigrationSink(Protocol):
    """Where migrations are counted (the HTTP service's FrontendMetrics)."""

    def migrated(self, model: str, migration_type: str) -> None: ...

    def migrations_from_zero(self, model: str) -> None: ...

    def migration_done(self, model: str, migration_type: str, success: bool, seconds: float) -> None: ...


class ModelObserver:
    """One model's per-request reports from its engine (``RemoteCoreEngine(observer=...)``)."""

    __slots__ = ("_wm", "model", "_sink")

    def __init__(self, wm: WorkerMetrics, model: str, sink: MigrationSink | None) -> None:
        self._wm = wm
        self.model = model
        self._sink = sink
        if sink is not None:
            sink.migrations_from_zero(model)

    def migrated(self, migration_type: str) -> None:
        if self._sink is not None:
            self._sink.migrated(self.model, migration_type)

    def migration_done(self, migration_type: str, success: bool, seconds: float) -> None:
        """A migration's stream started on another worker (``success``), or the request gave up."""
        if self._sink is not None:
            self._sink.migration_done(self.model, migration_type, success, seconds)

    def request(self, worker_id: int | None, isl: int) -> "RequestTiming | None":
        if worker_id is None:
            return None
        return RequestTiming(self, worker_id, isl)


class RequestTiming:
    """One request on one worker: its first item's time, and at the end the mean inter-token latency."""

    __slots__ = ("_obs", "worker_id", "isl", "start", "first_at")

    def __init__(self, obs: ModelObserver, worker_id: int, isl: int) -> None:
        self._obs = obs
        self.worker_id = worker_id
        self.isl = isl
        self.start = time.monotonic()
        self.first_at: float | None = None

    def first(self) -> None:
        self.first_at = time.monotonic()
        wm, labels = self._obs._wm, self._labels()
        if labels is None:
            return
        wm.last_ttft.labels(*labels).set(self.first_at - self.start)
        wm.last_isl.labels(*labels).set(self.isl)

    def done(self, tokens: int) -> None:
        if self.first_at is None or tokens < 2:
            return
        labels = self._labels()
        if labels is not None:
            self._obs._wm.last_itl.labels(*labels).set((time.monotonic() - self.first_at) / (tokens - 1))

    def _labels(self) -> tuple[str, str, str] | None:
        wm, model = self._obs._wm, self._obs.model
        if model not in wm._models.get(self.worker_id, ()):
            return None  # a worker that is gone (or not one of ours): no series to leave behind
        wm._timed.add(self.worker_id)
        return (str(self.worker_id), "0", WORKER_TYPE)


class QueueCollector:
    """``<prefix>_router_queue_pending_requests``: requests waiting because every worker is at its
    limit (``--queue-size``), per model (``queued()``: lowercased name -> count), read when /metrics is
    scraped.  ``policy_class`` is 1.6.1's label of its queue policies; ours has one, ``default``."""

    def __init__(self, queued: Callable[[], dict[str, int]], prefix: str) -> None:
        self.queued = queued
        self.name = f"{prefix}_router_queue_pending_requests"

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, "Requests waiting for a worker with room (every worker at its limit)",
                                   labels=["model", "policy_class", "worker_type"])
        for model, n in sorted(self.queued().items()):
            family.add_metric([model, "default", "decode"], n)
        yield family
