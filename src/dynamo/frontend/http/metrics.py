"""Prometheus metrics of the HTTP frontend (Dynamo's frontend metric names and buckets).

The prefix is ``dynamo_frontend``, or ``DYN_METRICS_PREFIX`` sanitised to a valid metric name.  Each
service gets its own registry so several services in one process (tests) do not collide.  With
``--http-workers N`` every process has its own metrics and a scrape is answered by whichever process
accepted the connection, so each sample carries ``http_worker="<index>"`` (sum over it in queries).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Iterator

from dynamo.frontend.http.listen import worker_index

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

DEFAULT_PREFIX = "dynamo_frontend"

# Dynamo 1.6.1's buckets (also the KV router's ISL/OSL/TTFT histograms: frontend/router_metrics.py)
ISL_BUCKETS = (0, 100, 210, 430, 870, 1800, 3600, 7400, 15000, 31000, 63000, 130000)
OSL_BUCKETS = (0, 100, 210, 430, 880, 1800, 3700, 7600, 16000, 32000)
TTFT_BUCKETS = (0, .0022, .0047, .01, .022, .047, .1, .22, .47, 1, 2.2, 4.7, 10, 22, 48, 100, 220, 480)


def metrics_prefix() -> str:
    raw = os.environ.get("DYN_METRICS_PREFIX")
    if not raw:
        return DEFAULT_PREFIX
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", raw)
    if not re.match(r"[a-zA-Z_:]", name):
        name = "_" + name
    return name


class FrontendMetrics:
    """The frontend's Prometheus metrics.

    The Prometheus objects (and ``prometheus_client`` itself, about a tenth of the server's start-up) are
    made on first use: the first request or scrape, or :meth:`prepare_in_background` once the server
    listens.  Until then only the prefix exists; any other attribute access builds them.
    """

    def __init__(self, prefix: str | None = None):
        self.prefix = prefix or metrics_prefix()  # for metrics added by others (dynamo.frontend.worker_metrics)

    def __getattr__(self, name: str) -> Any:
        if name in _LAZY and "itl" not in self.__dict__:
            self._build()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _build(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        p = self.prefix
        r = CollectorRegistry()
        self.registry = r
        self.requests = Counter(f"{p}_requests", "Requests handled",
                                ["model", "endpoint", "request_type", "status", "error_type"], registry=r)
        self.started = Counter(f"{p}_requests_started", "Requests started (admitted, their model known)",
                               ["model", "endpoint", "request_type"], registry=r)
        self.active = Gauge(f"{p}_active_requests", "Requests from arrival to their last byte", ["model"], registry=r)
        self.inflight = Gauge(f"{p}_inflight_requests", "Requests in flight (deprecated in Dynamo 1.x: "
                              "active_requests)", ["model"], registry=r)
        self.disconnected = Gauge(f"{p}_disconnected_clients", "Clients that went away before their answer ended",
                                  registry=r)
        # Dynamo 1.6.1's buckets, as its scrape shows them (tests/unit/metrics/data)
        self.duration = Histogram(f"{p}_request_duration_seconds", "Request duration", ["model"],
                                  buckets=(0, 2, 4, 8, 16, 32, 64, 130, 260, 510), registry=r)
        self.isl = Histogram(f"{p}_input_sequence_tokens", "Input sequence length in tokens", ["model"],
                             buckets=ISL_BUCKETS, registry=r)
        self.osl = Histogram(f"{p}_output_sequence_tokens", "Output sequence length in tokens", ["model"],
                             buckets=OSL_BUCKETS, registry=r)
        self.output_tokens = Counter(f"{p}_output_tokens", "Output tokens generated", ["model"], registry=r)
        self.cached = Histogram(f"{p}_cached_tokens", "Number of cached tokens (prefix cache hits) per request",
                                ["model"], buckets=ISL_BUCKETS, registry=r)
        # TTFT and ITL keep our buckets, not 1.6.1's: the planner reads its p90s from them (planner/observe.py),
        # and 1.6.1's ITL bounds (.035, .064) straddle a 50 ms target so coarsely that its learned capacity
        # over-provisioned (tests/integration/test_planner_capacity.py: 4 workers for 2); a bucket bound at the
        # usual targets (.05 s ITL, .25/.5 s TTFT) keeps it right. Names, types and labels are 1.6.1's.
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=(0, .001, .005, .01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120, 240,
                                       480), registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Inter-token latency", ["model"],
                             buckets=(0, .001, .005, .01, .015, .02, .025, .05, .1, .25, .5, 1, 2), registry=r)
        # Dynamo 1.x names (docs/metrics.md): requests not yet at their first token, overload, migrations
        self.queued = Gauge(f"{p}_queued_requests", "Requests that have not had their first token yet",
                            ["model"], registry=r)
        self.rejections = Counter(f"{p}_model_rejection", "Requests answered 503 because every worker was busy "
                                  "(queue full or wait over) or the frontend was at --max-inflight",
                                  ["model", "endpoint"], registry=r)
        self.migrations = Counter(f"{p}_model_migration", "Requests sent to another worker: ongoing_request "
                                  "(a worker died, froze or drained mid-stream), new_request (an instance had no responder)",
                                  ["model", "migration_type"], registry=r)
        self.migration_duration = Histogram(
            f"{p}_model_migration_duration_seconds", "From a stream's loss to its stream on another worker (outcome "
            "success) or to giving up (failure)", ["model", "migration_type", "outcome"],
            buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40, 60), registry=r)

    def rejected(self, model: str, endpoint: str) -> None:
        self.rejections.labels(model.lower(), endpoint).inc()

    def migrated(self, model: str, migration_type: str) -> None:
        self.migrations.labels(model.lower(), migration_type).inc()

    def migrations_from_zero(self, model: str) -> None:
        """The model's migration counters, at 0 before its first migration: Prometheus's ``increase()`` takes
        a series' first sample as its start, so a counter born at 1 would never show its first migration."""
        for migration_type in ("ongoing_request", "new_request"):
            self.migrations.labels(model.lower(), migration_type)

    def migration_done(self, model: str, migration_type: str, success: bool, seconds: float) -> None:
        self.migration_duration.labels(model.lower(), migration_type, "success" if success else "failure").observe(seconds)

    def client_gone(self) -> None:
        self.disconnected.inc()

    @staticmethod
    def prepare_in_background() -> None:
        """Import ``prometheus_client`` in a thread, so the first request does not wait for it."""
        if "prometheus_client" not in sys.modules:
            threading.Thread(target=importlib.import_module, args=("prometheus_client",), daemon=True,
                             name="import-prometheus").start()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        index = worker_index()
        if index is None:
            return generate_latest(self.registry)
        return generate_latest(_WithLabel(self.registry, "http_worker", str(index)))

    def request(self, model: str, endpoint: str, streaming: bool) -> "RequestMetrics":
        return RequestMetrics(self, model.lower(), endpoint, "stream" if streaming else "unary")

    def for_model(self, model: str) -> "_ModelSeries":
        """The per-model series, looked up once per model: ``labels()`` takes a lock and builds a key
        (2.5-3 µs each, nine per request: about a tenth of a short request's frontend CPU)."""
        series = self.__dict__.get("_series")
        if series is None:
            series = self.__dict__["_series"] = {}
        found = series.get(model)
        if found is None:
            found = series[model] = _ModelSeries(self, model)
        return found


class _ModelSeries:
    """One model's children of the frontend's metrics (the same objects ``labels(model)`` returns)."""

    __slots__ = ("inflight", "active", "queued", "itl", "ttft", "isl", "duration", "osl", "output_tokens",
                 "cached", "_requests", "_started", "_m", "_model")

    def __init__(self, m: FrontendMetrics, model: str):
        self.inflight = m.inflight.labels(model)
        self.active = m.active.labels(model)
        self.output_tokens = m.output_tokens.labels(model)
        self.queued = m.queued.labels(model)
        self.itl = m.itl.labels(model)
        self.ttft = m.ttft.labels(model)
        self.isl = m.isl.labels(model)
        self.duration = m.duration.labels(model)
        self.osl = m.osl.labels(model)
        self.cached = m.cached.labels(model)
        self._requests: dict[tuple[str, str, str, str], Any] = {}
        self._started: dict[tuple[str, str], Any] = {}
        self._m = m
        self._model = model

    def requests(self, endpoint: str, request_type: str, status: str, error_type: str) -> Any:
        key = (endpoint, request_type, status, error_type)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self._m.requests.labels(self._model, endpoint, request_type, status,
                                                                  error_type)
        return child

    def started(self, endpoint: str, request_type: str) -> Any:
        key = (endpoint, request_type)
        child = self._started.get(key)
        if child is None:
            child = self._started[key] = self._m.started.labels(self._model, endpoint, request_type)
        return child


ITL_FLUSH_EVERY = 64  # tokens whose inter-token latencies are counted locally before the histogram sees them


class RequestMetrics:
    """One request's bookkeeping; ``token`` is called as output arrives, ``done`` once at the end.

    Inter-token latencies are counted per token, so they are the one per-token metric: a
    ``Histogram.observe`` (a lock and a bucket scan, several us) per token was a tenth of the frontend's
    CPU per token.  They are binned here instead and added to the histogram's buckets every
    ``ITL_FLUSH_EVERY`` tokens and when the request ends: the same counts and sum, a scrape during a
    request sees its latencies up to 63 tokens late.
    """

    __slots__ = ("_s", "model", "endpoint", "request_type", "_start", "_last", "_tokens", "_itl", "_first",
                 "_bounds", "_itl_counts", "_flushed_at", "_flushed_tokens", "_queued")

    def __init__(self, m: FrontendMetrics, model: str, endpoint: str, request_type: str):
        s = self._s = m.for_model(model)
        self.model = model
        self.endpoint = endpoint
        self.request_type = request_type
        self._start = self._last = time.monotonic()
        self._tokens = 0
        self._first = True
        self._itl = s.itl
        self._bounds = self._itl._upper_bounds  # the histogram's own bucket bounds (+Inf last)
        self._itl_counts = [0] * len(self._bounds)
        # the latencies binned but not yet in the histogram are those after these: their sum telescopes
        # to the time between, so only the bucket counts are kept per token
        self._flushed_at = self._start
        self._flushed_tokens = 0
        s.inflight.inc()
        s.active.inc()
        s.started(endpoint, request_type).inc()
        self._queued = s.queued  # until the first token (Dynamo's queued_requests)
        self._queued.inc()

    def tokens(self, total_tokens: int, prompt_tokens: int, cached_tokens: int | None = None) -> None:
        """Called after each chunk with the running output count (on the per-token path: kept lean);
        ``cached_tokens``: the prompt tokens the worker found cached (None: its engine does not say)."""
        new = total_tokens - self._tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self._first:
            self._first = False
            self._queued.dec()
            self._s.ttft.observe(now - self._start)
            self._s.isl.observe(prompt_tokens)
            if cached_tokens is not None:
                self._s.cached.observe(cached_tokens)
            self._s.output_tokens.inc(total_tokens)  # the rest when the binned latencies are flushed
            self._flushed_at = now
            self._flushed_tokens = total_tokens
        else:
            # the bucket Histogram.observe would pick: the first bound >= the gap, once per token
            self._itl_counts[bisect_left(self._bounds, (now - self._last) / new)] += new
            if total_tokens - self._flushed_tokens >= ITL_FLUSH_EVERY:
                self._last = now
                self._tokens = total_tokens
                self._flush_itl()
                return
        self._last = now
        self._tokens = total_tokens

    def _flush_itl(self) -> None:
        """Hand the binned latencies up to the last token to the histogram."""
        if self._tokens == self._flushed_tokens:
            return
        child = self._itl
        counts = self._itl_counts
        for i, n in enumerate(counts):
            if n:
                child._buckets[i].inc(n)
                counts[i] = 0
        child._sum.inc(self._last - self._flushed_at)
        self._s.output_tokens.inc(self._tokens - self._flushed_tokens)
        self._flushed_at = self._last
        self._flushed_tokens = self._tokens

    def done(self, ok: bool, error_type: str = "") -> None:
        """``error_type``: why a failed request failed (admission.py's classes); "" for a success."""
        self._flush_itl()
        s = self._s
        if self._first:  # ended (or failed) before its first token
            self._first = False
            self._queued.dec()
        s.inflight.dec()
        s.active.dec()
        s.requests(self.endpoint, self.request_type, "success" if ok else "error", "" if ok else error_type).inc()
        s.duration.observe(time.monotonic() - self._start)
        s.osl.observe(self._tokens)


_LAZY = frozenset(("registry", "requests", "started", "active", "inflight", "disconnected", "duration", "isl", "osl",
                   "cached", "output_tokens", "ttft", "itl", "queued", "rejections", "migrations", "migration_duration"))


class _WithLabel:
    """A registry's metrics with one more label on every sample (``--http-workers``: which process answered)."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self.registry, self.name, self.value = registry, name, value

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, self.name: self.value}) for s in family.samples]
            yield family
