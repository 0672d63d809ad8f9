"""The ``dynamo_component_*`` series a worker counts for every endpoint it serves, as Dynamo's
workers do (so the same dashboards work).

Names, types, labels and buckets are Dynamo 1.x's (``dynamo_namespace``, ``dynamo_component``,
``dynamo_endpoint``, and ``worker_id``: this process's instance id in hex, as 1.6.1 labels its series), so
its dashboards read them unchanged.  The ingress counts per request, never per token: a request's
response bytes are added up locally while it streams and reach the counter once, when it ends.  The
table of every series is in docs/metrics.md.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

PREFIX = "dynamo_component"
LABELS = ("dynamo_namespace", "dynamo_component", "dynamo_endpoint", "worker_id")

# dynamo_component_errors_total{error_type=...}: the stage of request handling that failed (Dynamo's values)
ERROR_DESERIALIZATION = "deserialization"  # the request frame or its JSON body could not be decoded
ERROR_INVALID_MESSAGE = "invalid_message"  # decodable, but not a request we can serve (unknown transport)
ERROR_RESPONSE_STREAM = "response_stream"  # the response stream back to the caller could not be opened
ERROR_GENERATE = "generate"  # the handler raised (at its start or mid-stream)

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class ComponentMetrics:
    """One registry per runtime: its endpoints' request series and the runtime's uptime."""

    def __init__(self) -> None:
        # imported here: a runtime without a status server never loads prometheus_client (start-up time)
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry: CollectorRegistry = CollectorRegistry()
        r = self.registry
        self.started = time.monotonic()
        self.requests = Counter(f"{PREFIX}_requests", "Requests received by the endpoint", LABELS, registry=r)
        self.request_bytes = Counter(f"{PREFIX}_request_bytes", "Bytes of request bodies received", LABELS, registry=r)
        self.response_bytes = Counter(f"{PREFIX}_response_bytes", "Bytes of response frames sent", LABELS, registry=r)
        self.inflight = Gauge(f"{PREFIX}_inflight_requests", "Requests being served now", LABELS, registry=r)
        self.duration = Histogram(f"{PREFIX}_request_duration_seconds", "Time from a request's ack to its last frame",
                                  LABELS, buckets=DURATION_BUCKETS, registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "Requests that failed, by the stage that failed",
                              (*LABELS, "error_type"), registry=r)
        self.cancellations = Counter(f"{PREFIX}_cancellation", "Requests their caller cancelled (kill or stop)",
                                     LABELS, registry=r)
        self.worker_id = ""  # known once an endpoint serves (the instance id is the runtime's lease)
        r.register(_Uptime(self))

    def endpoint(self, namespace: str, component: str, endpoint: str, worker_id: str = "") -> "EndpointMetrics":
        self.worker_id = worker_id
        return EndpointMetrics(self, (namespace, component, endpoint, worker_id))


class _Uptime:
    """``dynamo_component_uptime_seconds{worker_id}``, read at scrape time (the label is known late)."""

    def __init__(self, m: ComponentMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator["Metric"]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(f"{PREFIX}_uptime_seconds", "Seconds since the runtime started", labels=["worker_id"])
        family.add_metric([self.m.worker_id], time.monotonic() - self.m.started)
        yield family


class EndpointMetrics:
    """One endpoint's series with their labels bound once (a labelled lookup per request is avoidable)."""

    __slots__ = ("_m", "_labels", "requests", "request_bytes", "response_bytes", "inflight", "duration", "cancellations")

    def __init__(self, m: ComponentMetrics, labels: tuple[str, str, str, str]) -> None:
        self._m = m
        self._labels = labels
        self.requests = m.requests.labels(*labels)
        self.request_bytes = m.request_bytes.labels(*labels)
        self.response_bytes = m.response_bytes.labels(*labels)
        self.inflight = m.inflight.labels(*labels)
        self.duration = m.duration.labels(*labels)
        self.cancellations = m.cancellations.labels(*labels)
        for error_type in (ERROR_DESERIALIZATION, ERROR_INVALID_MESSAGE, ERROR_RESPONSE_STREAM, ERROR_GENERATE):
            m.errors.labels(*labels, error_type)  # present at 0 from the start, so rate() works at once

    def received(self, nbytes: int) -> None:
        self.requests.inc()
        self.request_bytes.inc(nbytes)

    def error(self, error_type: str) -> None:
        self._m.errors.labels(*self._labels, error_type).inc()

    def cancelled(self) -> None:
        self.cancellations.inc()

    def started(self) -> float:
        self.inflight.inc()
        return time.monotonic()

    def finished(self, start: float, sent_bytes: int) -> None:
        self.inflight.dec()
        self.duration.observe(time.monotonic() - start)
        if sent_bytes:
            self.response_bytes.inc(sent_bytes)

