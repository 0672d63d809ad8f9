"""Per-worker load on the frontend's ``/metrics``: the workers' ForwardPassMetrics as Prometheus gauges.

Workers that report their load (the mocker; spec 6.3) publish ``{"worker_id", "data": <metrics>}`` on
NATS ``namespace.<ns>.kv_metrics`` whenever their KV usage or queue changes, and answer the same
metrics on their ``load_metrics`` endpoint.  For every namespace of a discovered model the frontend
subscribes to the subject; when a worker is discovered it also asks its ``load_metrics`` endpoint once,
so an idle worker shows up before it publishes anything.  Gauges (labels ``model``, lowercased as in
spec 4.8, ``worker_id`` in decimal, ``dp_rank``), with the frontend's metric prefix::

    <prefix>_worker_kv_active_blocks        kv_stats.kv_active_blocks
    <prefix>_worker_kv_total_blocks         kv_stats.kv_total_blocks
    <prefix>_worker_kv_cache_usage_ratio    kv_stats.gpu_cache_usage_perc (0..1)
    <prefix>_worker_prefix_cache_hit_rate   kv_stats.gpu_prefix_cache_hit_rate (0..1)
    <prefix>_worker_requests_waiting        worker_stats.num_requests_waiting
    <prefix>_worker_request_active_slots    worker_stats.request_active_slots
    <prefix>_worker_request_total_slots     worker_stats.request_total_slots

The flat [0.3] shape (all fields at the top level) is read too.  A worker's series disappear when its
model entry does (it stopped or died).  Messages from workers this frontend does not serve are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Gauge

from dynamo.runtime.names import namespace_event_subject

log = logging.getLogger(__name__)

LOAD_METRICS_ENDPOINT = "load_metrics"
POLL_TIMEOUT_S = 2.0

# gauge suffix, help, (section, field)
_FIELDS = (
    ("worker_kv_active_blocks", "KV cache blocks in use on a worker", ("kv_stats", "kv_active_blocks")),
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

    def __init__(self, runtime: Any, registry: CollectorRegistry, prefix: str):
        self.runtime = runtime
        self.gauges = [(Gauge(f"{prefix}_{suffix}", doc, ["model", "worker_id", "dp_rank"], registry=registry), path)
                       for suffix, doc, path in _FIELDS]
        self._models: dict[int, set[str]] = {}  # worker id -> models it serves (lowercased)
        self._ranks: dict[int, set[str]] = {}  # worker id -> dp ranks seen
        self._subs: dict[str, Any] = {}  # namespace -> subscription
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: dict[tuple[str, str], Any] = {}  # (namespace, component) -> load_metrics client
        self._closed = False

    # -- discovery -----------------------------------------------------------------------------
    async def add_worker(self, namespace: str, component: str, worker_id: int, model: str) -> None:
        """A worker serving ``model`` was discovered."""
        if self._closed:
            return
        self._models.setdefault(worker_id, set()).add(model.lower())
        if namespace not in self._subs:
            subject = namespace_event_subject(namespace, "kv_metrics")

            async def on_message(msg: Any) -> None:
                self.apply(msg.data)

            try:
                self._subs[namespace] = await self.runtime.nats.subscribe(subject, cb=on_message)
            except Exception as e:  # metrics must never break discovery
                log.warning("cannot subscribe to %s: %s", subject, e)
        task = asyncio.create_task(self._poll(namespace, component, worker_id), name="load-metrics-poll")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def remove_worker(self, worker_id: int, model: str | None = None) -> None:
        """The worker's entry for ``model`` (or for every model, with None) went away."""
        models = self._models.get(worker_id)
        if not models:
            return
        gone = set(models) if model is None else {model.lower()} & models
        for m in gone:
            for rank in self._ranks.get(worker_id, ()):
                for gauge, _ in self.gauges:
                    try:
                        gauge.remove(m, str(worker_id), rank)
                    except KeyError:
                        pass
        models -= gone
        if not models:
            del self._models[worker_id]
            self._ranks.pop(worker_id, None)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs.values():
            try:
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
    def apply(self, raw: bytes | str | dict[str, Any]) -> bool:
        """One ``kv_metrics`` message; False if it was not usable or not about one of our workers."""
        try:
            msg = raw if isinstance(raw, dict) else orjson.loads(raw)
            worker_id = int(msg["worker_id"])
            data = msg["data"]
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as e:
            log.debug("bad kv_metrics message skipped: %s", e)
            return False
        return self.set(worker_id, data)

    def set(self, worker_id: int, data: Any) -> bool:
        models = self._models.get(worker_id)
        if not models or not isinstance(data, dict):
            return False
        ws = data.get("worker_stats") if isinstance(data.get("worker_stats"), dict) else data
        rank = str(int(ws.get("data_parallel_rank") or 0))
        self._ranks.setdefault(worker_id, set()).add(rank)
        wid = str(worker_id)
        for gauge, (section, name) in self.gauges:
            part = data.get(section) if isinstance(data.get(section), dict) else data
            value = part.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                for m in models:
                    gauge.labels(m, wid, rank).set(value)
        return True

    async def _poll(self, namespace: str, component: str, worker_id: int) -> None:
        """Ask a newly discovered worker's ``load_metrics`` endpoint once (workers without one: nothing)."""
        try:
            async with asyncio.timeout(POLL_TIMEOUT_S):
                key = (namespace, component)
                client = self._clients.get(key)
                if client is None:
                    endpoint = self.runtime.namespace(namespace).component(component).endpoint(LOAD_METRICS_ENDPOINT)
                    client = self._clients[key] = await endpoint.client()
                while worker_id not in client.instance_ids():
                    await asyncio.sleep(0.05)
                async for item in client.direct({}, worker_id):
                    self.set(worker_id, item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no such endpoint, worker gone, timeout: the pushed metrics will do
            log.debug("load_metrics of worker %x not read: %s", worker_id, e or type(e).__name__)
