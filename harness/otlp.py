"""A trace collector for tests: it takes OTLP exports over gRPC (the collector's ``TraceService/Export``) and
over HTTP (``POST /v1/traces``, protobuf), as a real OpenTelemetry Collector does, and keeps the spans.

Why our own and not a collector binary: the tests read the spans back (ids, parents, attributes, events),
and the collector protocol's message types come with ``opentelemetry-proto`` (the ``tracing`` extra).
"""

from __future__ import annotations

import secrets
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harness.proc import free_port
from harness.wait import wait_until

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass
class Span:
    """One received span, its ids in lowercase hex (``parent`` empty for a root)."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error: bool = False
    start_ns: int = 0
    end_ns: int = 0
    resource: dict[str, Any] = field(default_factory=dict)  # the sending process's (process.pid, ...)


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Listens on two loopback ports: :attr:`grpc_endpoint` and :attr:`http_endpoint` (the URL an exporter's
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` takes for each protocol)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = 0
        self.http_port = 0

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def take(self, request: Any) -> None:
        """Keep the spans of one ExportTraceServiceRequest."""
        got = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service=service, name=s.name, kind=KINDS.get(s.kind, str(s.kind)),
                                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                    parent=s.parent_span_id.hex(), attributes=_attrs(s.attributes),
                                    events=[(e.name, _attrs(e.attributes)) for e in s.events],
                                    error=s.status.code == 2, start_ns=s.start_time_unix_nano,
                                    end_ns=s.end_time_unix_nano, resource=resource))
        with self._lock:
            self.spans += got

    def start(self) -> "OtlpReceiver":
        receiver = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's name
                receiver.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.grpc_port = free_port()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
        server.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        server.start()
        self._grpc = server

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces" or "protobuf" not in (self.headers.get("Content-Type") or ""):
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done: Callable[[list[Span]], bool], timeout: float, what: str) -> list[Span]:
        """The trace's spans once ``done(spans)`` holds (else the test fails after ``timeout``)."""
        wait_until(lambda: done(self.of_trace(trace_id)), timeout, what)
        return self.of_trace(trace_id)


def exporter_env(receiver: OtlpReceiver, protocol: str = "grpc", service: str | None = None) -> dict[str, str]:
    """The environment that makes a process trace into ``receiver``, as an operator's would (Dynamo 1.x's
    variables), its batches sent every 100 ms so that a test does not wait the default 5 s."""
    env = {"OTEL_EXPORT_ENABLED": "true", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint if protocol == "grpc"
           else receiver.http_endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    if service is not None:
        env["OTEL_SERVICE_NAME"] = service
    return env


def traceparent() -> tuple[str, str, str]:
    """A client's fresh W3C ``traceparent``: (the header, its trace id, the client's span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[Span], **match: Any) -> Span:
    """The one span whose fields match (the test fails naming what it found otherwise)."""
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name, s.kind) for s in spans])
    return found[0]
