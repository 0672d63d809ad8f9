"""Traces across process layouts other than ``dynamo-run``'s frontend and workers, read back by a real OTLP
receiver (harness/otlp.py): a ``dynamo serve`` graph of three services (one trace whose spans nest from
the HTTP service down the request plane to the last service), and ``--http-workers 2`` (each forked
frontend process exports its own spans).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from harness.otlp import exporter_env, one, traceparent
from harness.proc import DynamoRun
from harness.serve_graph import GraphStarter
from harness.wait import wait_until

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (pip install -e '.[tracing]')")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello_world"








def test_a_dynamo_serve_graph_gives_one_trace_nested_across_its_services(tmp_path, receiver):
    with GraphStarter(tmp_path, HELLO) as serve:
        g = serve("hello_world:Frontend", "-f", "config.yaml", want={"Frontend": 1, "Middle": 1, "Backend": 1},
                  env=exporter_env(receiver, "http/protobuf"))
        header, trace_id, client_span = traceparent()
        r = httpx.post(f"http://127.0.0.1:{g.http_port}/generate", json={"text": "test"}, timeout=30,
                       headers={"traceparent": header})
        assert r.status_code == 200 and r.text == "Frontend: Middle: Backend: test-mid-back", r.text
        # a service's server span ends after its other spans of the request: once all three are in, all are
        spans = receiver.wait_for(trace_id, lambda ss: {s.service for s in ss if s.kind == "server"}
                                  == {"Frontend", "Middle", "Backend"}, 15, "the spans of the three services")
    # each service names its spans (the service's class, no OTEL_SERVICE_NAME given)
    assert {s.service for s in spans} == {"Frontend", "Middle", "Backend"}
    front = one(spans, service="Frontend", kind="server")
    assert front.parent == client_span and front.name == "POST /generate"
    # Frontend -> (request plane) -> Middle -> (request plane) -> Backend, each hop a client span
    to_middle = one(spans, service="Frontend", kind="client")
    assert to_middle.parent == front.span_id
    middle = one(spans, service="Middle", kind="server")
    assert middle.parent == to_middle.span_id
    to_backend = one(spans, service="Middle", kind="client")
    assert to_backend.parent == middle.span_id
    backend = one(spans, service="Backend", kind="server")
    assert backend.parent == to_backend.span_id
    assert not any(s.error for s in spans)


def test_each_http_worker_process_exports_its_own_spans(receiver):
    """The exporter (and its thread) is made in each forked frontend process: requests that reach either
    process are traced, each span saying the process that made it."""
    pids: dict[int, str] = {}
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2",
                   env={**exporter_env(receiver), "OTEL_SERVICE_NAME": "forked"}) as fe:
        children = [int(p) for p in Path(f"/proc/{fe.pid}/task/{fe.pid}/children").read_text().split()]

        def both() -> bool:
            header, trace_id, client_span = traceparent()
            with httpx.Client(timeout=20) as client:  # a fresh connection: the kernel picks a process anew
                r = client.post(fe.base_url + "/v1/chat/completions", headers={"traceparent": header},
                                json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            (span,) = receiver.wait_for(trace_id, lambda ss: len(ss) == 1, 15, "the request's span")
            assert span.service == "forked" and span.kind == "server" and span.parent == client_span
            pids[span.resource["process.pid"]] = trace_id
            return len(pids) == 2

        wait_until(both, 30, "spans from both HTTP worker processes")
    assert sorted(pids) == sorted(children)
