"""One trace across the two implementations: a client's ``traceparent`` through Dynamo 1.6.1's frontend into our
worker, and through our frontend into 1.6.1's mocker, the W3C context carried in 1.x's request headers; every
process exporting to one OTLP receiver (harness/otlp.py) with 1.x's own variables (``OTEL_EXPORT_ENABLED``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_SERVICE_NAME``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.dynamo1x import d16_env, d16_frontend, d16_mocker
from harness.dynamo1x_kv import SRC
from harness.otlp import OtlpReceiver, Span, exporter_env, traceparent
from harness.proc import DynamoRun, DynamoWorker

from .test_d16_serving import wait_listed


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def traced_completion(url: str, model: str) -> tuple[str, str]:
    """(trace id, the client's span id) of one streamed completion sent with a fresh ``traceparent``."""
    header, trace_id, parent = traceparent()
    body = {"model": model, "prompt": "hello there", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"traceparent": header}) as reply:
        assert reply.status_code == 200, reply.read()
        assert any(line == "data: [DONE]" for line in reply.iter_lines())
    return trace_id, parent


def services(spans: list[Span]) -> set[str]:
    return {s.service for s in spans}


def complete(spans: list[Span], *names: str) -> bool:
    """Every named process exported, and every span's parent (but the client's) is in: processes export in
    batches of their own, and a server span, ended last, may come in a later batch than its children."""
    ids = {s.span_id for s in spans}
    return set(names) <= services(spans) and sum(s.parent not in ids for s in spans) <= 1


def test_d16_frontend_and_our_worker_share_the_clients_trace(tiny_chat_5k: Path, store: Path,
                                                             receiver: OtlpReceiver) -> None:
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, **exporter_env(receiver, service="our-worker"))
    with DynamoWorker("in=dyn://tr.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "our-mock",
                      env=ours, startup_timeout=60), \
            d16_frontend(dict(theirs, **exporter_env(receiver, service="d16-frontend")), model="our-mock") as fe:
        trace_id, client_span = traced_completion(fe.url, "our-mock")
        spans = receiver.wait_for(trace_id, lambda got: complete(got, "our-worker", "d16-frontend"), 30,
                                  "spans of both processes in the client's trace")
        by_id = {s.span_id: s for s in spans}
        worker_root = next(s for s in spans if s.service == "our-worker" and s.kind == "server")
        # our worker's server span hangs off a span of 1.6.1's frontend, which hangs off the client's
        assert by_id[worker_root.parent].service == "d16-frontend", (worker_root, by_id.get(worker_root.parent))
        assert any(s.parent == client_span for s in spans if s.service == "d16-frontend")


def test_our_frontend_and_d16_mocker_share_the_clients_trace(tiny_chat_5k: Path, store: Path,
                                                             receiver: OtlpReceiver) -> None:
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, **exporter_env(receiver, service="our-frontend"))
    with d16_mocker(tiny_chat_5k, "dyn://tr16.backend.generate", dict(theirs, **exporter_env(receiver,
                    service="d16-mocker")), "--speedup-ratio", "0", model_name="m16-model", store=store), \
            DynamoRun("out=dyn", env=ours, startup_timeout=60) as fe:
        wait_listed(fe.base_url, "m16-model")
        trace_id, client_span = traced_completion(fe.base_url, "m16-model")
        spans = receiver.wait_for(trace_id, lambda got: complete(got, "our-frontend", "d16-mocker"), 30,
                                  "spans of both processes in the client's trace")
        by_id = {s.span_id: s for s in spans}
        theirs_top = [s for s in spans if s.service == "d16-mocker" and by_id.get(s.parent) is None
                      or s.service == "d16-mocker" and by_id[s.parent].service != "d16-mocker"]
        assert theirs_top and all(by_id[s.parent].service == "our-frontend" for s in theirs_top), theirs_top
        assert any(s.parent == client_span for s in spans if s.service == "our-frontend")
