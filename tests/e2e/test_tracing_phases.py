"""OpenTelemetry traces of every generating route, of the queues and of a disaggregated request, read back
by a real OTLP receiver (harness/otlp.py).

Real processes on the file store (no etcd, no NATS): a KV-routing frontend (``--enable-anthropic-api``,
``--max-local-prefill-length 32``), a prefill mocker, a decode mocker that takes two requests at once
(``--max-inflight 2``) and runs one (``max_num_seqs`` 1), and an ``echo_core --embedding`` worker.  So a
third request waits in the frontend's queue, a second in the mocker's scheduler, and a long prompt's KV
state moves from the prefill worker to the decode worker.
"""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import (
    NO_INFRA_ENV,
    WORKER_LOG,
    kv_frontend,
    sees_instances,
    served_by,
    sse_events,
    workers_running,
    write_engine_args,
)
from harness.otlp import OtlpReceiver, Span, exporter_env, one, traceparent
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (pip install -e '.[tracing]')")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

MODEL = "phased"
EMBED = "phased-emb"
BLOCK = 16
KV_BYTES_PER_TOKEN = 1000
MOCKER = {"num_gpu_blocks": 512, "block_size": BLOCK, "speedup_ratio": 1.0, "max_num_seqs": 1,
          "kv_bytes_per_token": KV_BYTES_PER_TOKEN}
FRONTEND = "dynamo-frontend"




@pytest.fixture(scope="module")
def fleet(receiver: OtlpReceiver, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tracing-phases")
    env = {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp / "store")}
    args = write_engine_args(tmp / "mocker.json", MOCKER)
    mocker = ["out=mocker", str(tiny_model), "--model-name", MODEL, "--extra-engine-args", str(args)]

    def worker(name: str, *argv: str) -> DynamoWorker:
        return DynamoWorker(*argv, env={**env, **WORKER_LOG, **exporter_env(receiver, "http/protobuf", service=name)})

    workers = {"prefill": worker("prefill", f"in=dyn://{MODEL}.prefill.generate", *mocker,
                                 "--disaggregation-mode", "prefill"),
               "decode": worker("decode", f"in=dyn://{MODEL}.backend.generate", *mocker,
                                "--disaggregation-mode", "decode", "--max-inflight", "2"),
               "embed": worker("embed", "in=dyn://emb.worker.generate", "out=echo_core", str(tiny_model),
                               "--embedding", "--model-name", EMBED)}
    with workers_running(list(workers.values())):
        with kv_frontend({**env, **exporter_env(receiver)}, "--max-local-prefill-length", "32",
                         "--enable-anthropic-api", ready=sees_instances(workers.values(), models=2),
                         what="the frontend to see the workers") as fe:
            yield {"frontend": fe, "workers": workers}






def child(spans: list[Span], parent: Span, name: str) -> Span:
    found = [s for s in spans if s.parent == parent.span_id and s.name == name]
    assert len(found) == 1, (parent.name, name, [(s.service, s.name, s.parent) for s in spans])
    return found[0]


def served(*services: str):
    """Each of ``services`` exported its server span: it ends after the process's other spans of the request."""
    return lambda ss: all(any(s.service == service and s.kind == "server" for s in ss) for service in services)


def worker_chain(spans: list[Span], server: Span, worker: str) -> Span:
    """frontend server -> route -> request plane -> the worker's server span, which it returns."""
    route = child(spans, server, "route")
    hop = one(spans, parent=route.span_id, kind="client")
    return one(spans, service=worker, kind="server", parent=hop.span_id)


def post(fe: DynamoRun, path: str, body: dict[str, Any], header: str, **headers: str) -> httpx.Response:
    r = httpx.post(fe.api_url.removesuffix("/v1") + path, json=body, timeout=30,
                   headers={"traceparent": header, **headers})
    assert r.status_code == 200, r.text
    return r


def test_responses_and_messages_are_traced_like_chat(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    for path, body, operation in [
        ("/v1/responses", {"model": MODEL, "input": "hi there", "max_output_tokens": 5}, "chat"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ]:
        header, trace_id, client_span = traceparent()
        post(fe, path, body, header)
        spans = receiver.wait_for(trace_id, served(FRONTEND, "decode"),
                                  15, f"the spans of {path}")
        server = one(spans, service=FRONTEND, kind="server")
        assert server.name == f"POST {path}" and server.parent == client_span
        assert server.attributes["gen_ai.operation.name"] == operation
        assert server.attributes["gen_ai.request.model"] == MODEL
        assert server.attributes["gen_ai.request.max_tokens"] == 5
        assert server.attributes["gen_ai.usage.output_tokens"] == 5
        assert server.attributes["gen_ai.usage.input_tokens"] > 0
        assert server.attributes["http.response.status_code"] == 200
        assert len([s for s in spans if s.parent == server.span_id and s.name == "preprocess"]) == 1
        worker = worker_chain(spans, server, "decode")
        assert child(spans, worker, "decode").attributes["gen_ai.usage.output_tokens"] == 5


def test_embeddings_are_traced_through_the_request_plane(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    header, trace_id, client_span = traceparent()
    r = post(fe, "/v1/embeddings", {"model": EMBED, "input": ["one two", "three"]}, header)
    spans = receiver.wait_for(trace_id, served(FRONTEND, "embed"), 15, "the embedding's spans")
    server = one(spans, service=FRONTEND, kind="server")
    assert server.parent == client_span
    assert server.attributes["gen_ai.operation.name"] == "embeddings"
    assert server.attributes["gen_ai.request.model"] == EMBED
    assert server.attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    hop = one(spans, parent=server.span_id, kind="client")
    one(spans, service="embed", kind="server", parent=hop.span_id)


def test_a_refused_request_is_traced_with_its_error(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    header, trace_id, client_span = traceparent()
    r = httpx.post(fe.api_url + "/responses", json={"model": "no-such-model", "input": "hi"}, timeout=30,
                   headers={"traceparent": header})
    assert r.status_code == 404
    spans = receiver.wait_for(trace_id, served(FRONTEND), 15, "the refused request's span")
    server = one(spans, service=FRONTEND, kind="server")
    assert server.name == "POST /v1/responses" and server.parent == client_span
    assert server.error and server.attributes["http.response.status_code"] == 404


def test_waits_in_the_frontend_queue_and_in_the_worker_scheduler_are_spans(fleet, receiver):
    """A streams; B is sent once A decodes (the worker takes it: two at once, but its scheduler runs one,
    so B waits there); C is sent once B reached the worker (the worker is at its limit: C waits in the
    frontend's queue)."""
    fe: DynamoRun = fleet["frontend"]
    decode: DynamoWorker = fleet["workers"]["decode"]
    ids = {k: traceparent() for k in "ABC"}
    rids = {k: f"q{k}-" + secrets.token_hex(4) for k in "ABC"}
    errors: list[Any] = []

    def send(k: str, max_tokens: int, first: threading.Event | None = None) -> None:
        try:
            with httpx.stream("POST", fe.api_url + "/completions", timeout=60,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True},
                              headers={"traceparent": ids[k][0], "x-request-id": rids[k]}) as resp:
                assert resp.status_code == 200
                for data in sse_events(resp):
                    if first is not None and data != "[DONE]" and json.loads(data).get("choices"):
                        first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append((k, e))
        finally:
            if first is not None:
                first.set()

    a_first = threading.Event()
    threads = [threading.Thread(target=send, args=("A", 60, a_first), daemon=True)]
    threads[0].start()
    assert a_first.wait(30)
    threads.append(threading.Thread(target=send, args=("B", 3), daemon=True))
    threads[1].start()
    wait_until(lambda: served_by([decode], rids["B"]), 10, "B on the decode worker")
    threads.append(threading.Thread(target=send, args=("C", 3), daemon=True))
    threads[2].start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    spans = {k: receiver.wait_for(ids[k][1], served(FRONTEND, "decode"), 15, f"{k}'s spans") for k in "ABC"}
    a_decode = one(spans["A"], service="decode", name="decode")
    for k in "ABC":
        ss = spans[k]
        server = one(ss, service=FRONTEND, kind="server")
        route = child(ss, server, "route")
        frontend_queue = [s for s in ss if s.parent == route.span_id and s.name == "queue"]
        # only C found the worker full
        assert len(frontend_queue) == (1 if k == "C" else 0), (k, frontend_queue)
        worker = worker_chain(ss, server, "decode")
        queue, prefill = child(ss, worker, "queue"), child(ss, worker, "prefill")
        # the mocker reports admission: the queue ends where the prefill starts
        assert queue.start_ns <= queue.end_ns == prefill.start_ns <= prefill.end_ns
    (c_queue,) = [s for s in spans["C"] if s.name == "queue" and s.service == FRONTEND]
    assert c_queue.attributes["dynamo.queue.admitted"] is True and not c_queue.error
    # B arrived while A decoded and was admitted only once A was done: its queue and prefill span A's end
    b_queue = one(spans["B"], service="decode", name="queue")
    b_prefill = one(spans["B"], service="decode", name="prefill")
    assert b_queue.start_ns < a_decode.end_ns <= b_prefill.end_ns


def test_a_disaggregated_request_shows_its_kv_transfer(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    header, trace_id, _ = traceparent()
    prompt = " ".join(f"word{i}" for i in range(60))  # far over --max-local-prefill-length: a remote prefill
    post(fe, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}, header)
    spans = receiver.wait_for(trace_id, served(FRONTEND, "decode", "prefill"), 15, "the three processes' spans")
    server = one(spans, service=FRONTEND, kind="server")
    decode_server = one(spans, service="decode", kind="server")
    transfer = child(spans, decode_server, "kv_transfer")
    tokens = transfer.attributes["dynamo.kv_transfer.tokens"]
    assert tokens == server.attributes["gen_ai.usage.input_tokens"]
    assert transfer.attributes["dynamo.kv_transfer.bytes"] == tokens * KV_BYTES_PER_TOKEN
    assert transfer.attributes["dynamo.kv_transfer.blocks"] == -(-tokens // BLOCK)
    assert not transfer.error
    # the fetch comes first, then the wait for the scheduler, then a prefill with nothing left to compute
    queue = child(spans, decode_server, "queue")
    assert transfer.end_ns <= queue.start_ns
    # the prefill worker's part of the same trace
    prefill_server = one(spans, service="prefill", kind="server")
    assert child(spans, prefill_server, "prefill").attributes["gen_ai.usage.input_tokens"] == tokens
