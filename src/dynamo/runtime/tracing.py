"""OpenTelemetry traces, switched on as Dynamo 1.x does: ``OTEL_EXPORT_ENABLED=true`` (docs/metrics.md, "Traces").

Why one module: it is the only place that imports ``opentelemetry`` (the optional ``tracing`` extra).  With
tracing off nothing of OpenTelemetry is imported and every hook below is a flag test that returns ``None``:
callers hold ``Span | None`` and test it, so a request pays a few of those tests and a token none
(benchmarks/tracing_overhead.py measures CPU per token off and on).

With tracing on, the SDK's own environment handling applies: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
(``grpc``, 1.x's and so our default, or ``http/protobuf``), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and its argument, ``OTEL_PROPAGATORS`` (W3C
``traceparent``/``tracestate`` by default), ``OTEL_BSP_*`` for the batch processor.  Spans leave in batches
from the SDK's own thread, never from the event loop; :func:`shutdown` flushes them when a process ends.

How a trace crosses processes: a client's ``traceparent`` is the parent of the frontend's server span; the
runtime client puts the context of its request-plane span in the request message's headers (1.x's place:
the TCP message's headers, or the NATS message's), and the worker's ingress makes its server span a child of it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Protocol

log = logging.getLogger(__name__)

ENABLED = os.environ.get("OTEL_EXPORT_ENABLED", "").strip().lower() in ("1", "true", "yes", "on")

# span kinds, by name (callers need no OpenTelemetry type)
SERVER = "server"
CLIENT = "client"
INTERNAL = "internal"

# the W3C trace-context keys, carried in a request's headers
TRACE_KEYS = ("traceparent", "tracestate")

Attributes = Mapping[str, Any]


class Span(Protocol):
    """The part of an OpenTelemetry span the hooks use."""

    def set_attribute(self, key: str, value: Any) -> Any: ...

    def add_event(self, name: str, attributes: Any = None, timestamp: Any = None) -> Any: ...

    def set_status(self, status: Any, description: str | None = None) -> None: ...

    def end(self, end_time: Any = None) -> None: ...


_tracer: Any = None
_provider: Any = None
_kinds: dict[str, Any] = {}
_api: Any = None  # what the hooks call of OpenTelemetry's API, bound once tracing starts (_Api)


class _Api:
    """OpenTelemetry's API functions the hooks call, imported once, when tracing starts."""

    def __init__(self) -> None:
        from opentelemetry import context, propagate, trace

        self.set_span_in_context = trace.set_span_in_context
        self.get_current_span = trace.get_current_span
        self.extract = propagate.extract
        self.inject = propagate.inject
        self.attach = context.attach
        self.detach = context.detach
        self.status = trace.Status
        self.error_code = trace.StatusCode.ERROR


class TracingSetupError(Exception):
    """Tracing was asked for and cannot run (the extra is not installed, an unknown protocol)."""


def init(default_service: str) -> None:
    """Start exporting this process's spans (once; nothing when tracing is off).  ``default_service`` is
    the service name unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``)
    says one.  Call it in the process that serves (after a fork): the batch processor's thread is
    per process."""
    global _tracer, _provider, _api
    if not ENABLED or _provider is not None:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingSetupError(f"OTEL_EXPORT_ENABLED is set but OpenTelemetry is not installed ({exc}); "
                                "pip install 'dynamo-run[tracing]'") from None
    exporter = _exporter()
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service}))
    # which process of a service (--http-workers N: N frontends under one name) sent a span
    resource = Resource({"process.pid": os.getpid()}).merge(resource)
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER, as the SDK reads it
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _api = _Api()
    _tracer = provider.get_tracer("dynamo")
    _kinds.update({SERVER: trace.SpanKind.SERVER, CLIENT: trace.SpanKind.CLIENT,
                   INTERNAL: trace.SpanKind.INTERNAL})
    log.info("tracing: exporting spans as %s over OTLP (%s)", resource.attributes.get(SERVICE_NAME),
             _protocol())


def _protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc").strip()


def _exporter() -> Any:
    """The OTLP exporter for the protocol asked for; each reads its endpoint, headers, timeout and TLS
    settings from the standard variables itself."""
    protocol = _protocol()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            return Http()
    except ImportError as exc:
        raise TracingSetupError(f"the OTLP {protocol} exporter is not installed ({exc}); "
                                "pip install 'dynamo-run[tracing]'") from None
    raise TracingSetupError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported: "
                            "use grpc or http/protobuf")


def shutdown() -> None:
    """Export what is still buffered and stop (a process's clean exit); blocking, so call it off the loop
    or once the loop is done."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def force_flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (blocking)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def start_span(name: str, parent: Span | None = None, *, kind: str = INTERNAL,
               attributes: Attributes | None = None, start_time: int | None = None) -> Span | None:
    """A new span, child of ``parent`` (else of this task's current span); None when tracing is off.
    ``start_time`` (``time.time_ns()``) for a phase recorded once it is over; end it with ``end(ns)``."""
    if _tracer is None:
        return None
    ctx = _api.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context=ctx, kind=_kinds[kind], attributes=attributes, start_time=start_time)


def start_remote_child(name: str, carrier: Mapping[str, Any] | None, *, kind: str = SERVER,
                       attributes: Attributes | None = None) -> Span | None:
    """A span whose parent came from another process: W3C ``traceparent``/``tracestate`` in ``carrier``
    (HTTP headers, a request's control JSON); a root span when it carries none.  None when tracing is off."""
    if _tracer is None:
        return None
    ctx = _api.extract({k: str(carrier[k]) for k in TRACE_KEYS if k in carrier}) if carrier else None
    return _tracer.start_span(name, context=ctx, kind=_kinds[kind], attributes=attributes)


def headers_of(span: Span | None) -> dict[str, str] | None:
    """The W3C headers that make ``span`` the parent in another process (None: nothing to carry)."""
    if span is None or _tracer is None:
        return None
    out: dict[str, str] = {}
    _api.inject(out, context=_api.set_span_in_context(span))
    return out or None


def current() -> Span | None:
    """This task's current span (what :func:`attach` made current), if one is recording."""
    if _tracer is None:
        return None
    span = _api.get_current_span()
    return span if span.is_recording() else None


def attach(span: Span | None) -> Any:
    """Make ``span`` this task's current span (its logs carry its ids; spans started without a parent
    are its children); the token for :func:`detach`.  Attach and detach in one coroutine, never across
    a generator's ``yield``."""
    if span is None or _tracer is None:
        return None
    return _api.attach(_api.set_span_in_context(span))


def detach(token: Any) -> None:
    if token is not None and _api is not None:
        _api.detach(token)


def log_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for a log line; None when there is none."""
    if _tracer is None:
        return None
    sc = _api.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


def fail(span: Span | None, message: str) -> None:
    """Mark ``span`` failed (status error, the message as its description)."""
    if span is None or _tracer is None:
        return
    span.set_status(_api.status(_api.error_code, message))
