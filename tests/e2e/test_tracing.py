"""OpenTelemetry traces as an operator switches them on (``OTEL_EXPORT_ENABLED``, the OTLP endpoint, the
service name), read back by a real OTLP receiver in the test (harness/otlp.py): a client's ``traceparent``
is the parent of one trace that spans the frontend, the request plane and the workers, a migration
included; JSONL log lines carry the ids of the span they were logged in; with tracing off nothing of
OpenTelemetry is even imported.

Real processes: a frontend (``--migration-limit 1``, exporting over gRPC as Dynamo 1.x does) and two mocker
workers (exporting over OTLP/HTTP), finding each other through the file store (no etcd, no NATS).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, WORKER_LOG, stream_killing_its_worker, wait_for_model, write_engine_args
from harness.otlp import OtlpReceiver, Span, exporter_env, one, traceparent
from harness.proc import DynamoRun, DynamoWorker, run_cli

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (pip install -e '.[tracing]')")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

ENDPOINT = "dyn://traced.backend.generate"
MODEL = "traced"
# slow enough that a stream is still going when a test kills its worker (about 20 ms a token)
MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 0.5}
JSONL = {"DYN_LOGGING_JSONL": "1"}




@pytest.fixture(scope="module")
def fleet(receiver: OtlpReceiver, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tracing")
    env = {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp / "store")}
    args = write_engine_args(tmp / "mocker.json", MOCKER_ARGS)
    workers = {name: DynamoWorker(f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--model-name", MODEL,
                                  "--extra-engine-args", str(args),
                                  env={**env, **WORKER_LOG, **JSONL,
                                       **exporter_env(receiver, "http/protobuf", service=name)}).start(wait=False)
               for name in ("worker-a", "worker-b")}
    fe = None
    try:
        for w in workers.values():
            w.wait_ready(60)
        fe = DynamoRun("out=dyn", "--migration-limit", "1", env={**env, **JSONL, **exporter_env(receiver)}).start()
        wait_for_model(fe, MODEL, ENDPOINT, 2, timeout=30)
        yield {"frontend": fe, "workers": workers}
    finally:
        if fe is not None:
            fe.stop()
        for w in workers.values():
            w.kill()






def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return [s for s in spans if s.parent == parent.span_id and (name is None or s.name == name)]


def jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_one_trace_spans_frontend_request_plane_and_both_workers_of_a_migration(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    workers: dict[str, DynamoWorker] = fleet["workers"]
    header, trace_id, client_span = traceparent()
    rid = "trace-" + secrets.token_hex(4)
    names = {w: n for n, w in workers.items()}

    def prefill_exported(victim: DynamoWorker) -> None:
        # its prefill span ended at its first token: once exported, the kill -9 loses only the rest
        name = names[victim]
        receiver.wait_for(trace_id, lambda ss: any(s.service == name and s.name == "prefill" for s in ss),
                          5, f"{name}'s prefill span")

    events, victim, done = stream_killing_its_worker(
        fe, MODEL, "tell me a long story " * 8, list(workers.values()), after_chunks=4, rid=rid, max_tokens=60,
        headers={"traceparent": header}, timeout=60, before_kill=prefill_exported)
    assert victim is not None and done
    assert not [e for e in events if "error" in e], events
    victim_name = next(n for n, w in workers.items() if w is victim)
    other_name, other = next((n, w) for n, w in workers.items() if w is not victim)

    def complete(ss: list[Span]) -> bool:
        return (any(s.service == "dynamo-frontend" and s.kind == "server" for s in ss)
                and any(s.service == other_name and s.name == "decode" for s in ss)
                and any(s.service == other_name and s.kind == "server" for s in ss))

    spans = receiver.wait_for(trace_id, complete, 15, "the frontend's and the second worker's spans")
    # three processes in the one trace the client started
    assert {s.service for s in spans} == {"dynamo-frontend", victim_name, other_name}
    server = one(spans, service="dynamo-frontend", kind="server")
    assert server.parent == client_span
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["gen_ai.usage.output_tokens"] == 60
    assert server.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert [e for e, _ in server.events].count("first_token") == 1
    assert len(children(spans, server, "preprocess")) == 1
    # the migration: an event naming both workers, and a route span per worker
    (migration,) = [a for e, a in server.events if e == "migration"]
    assert migration == {"dynamo.migration.from_worker": victim.instance_hex,
                         "dynamo.migration.to_worker": other.instance_hex}
    routes = sorted(children(spans, server, "route"), key=lambda s: s.attributes["dynamo.migration.attempt"])
    assert [r.attributes["dynamo.worker_id"] for r in routes] == [victim.instance_hex, other.instance_hex]
    # each route's request-plane span (the first broke with its worker), and the second worker's server span
    # under the second: frontend -> request plane -> worker, across processes
    first_hop, = children(spans, routes[0])
    second_hop, = children(spans, routes[1])
    assert first_hop.kind == second_hop.kind == "client" and first_hop.error and not second_hop.error
    assert first_hop.attributes["dynamo.worker_id"] == victim.instance_hex
    worker_server = one(spans, service=other_name, kind="server")
    assert worker_server.parent == second_hop.span_id
    prefill = one(spans, service=other_name, name="prefill")
    decode = one(spans, service=other_name, name="decode")
    assert prefill.parent == decode.parent == worker_server.span_id
    # the resumed request carries the prompt plus what the first worker generated; the mocker reports its cache
    assert prefill.attributes["gen_ai.usage.input_tokens"] > server.attributes["gen_ai.usage.input_tokens"]
    assert "gen_ai.usage.cache_read.input_tokens" in prefill.attributes
    assert decode.attributes["gen_ai.usage.output_tokens"] > 0
    # the killed worker got as far as its prefill, in this trace, under a server span that died with it
    victim_prefill = one(spans, service=victim_name, name="prefill")
    assert victim_prefill.parent not in {s.span_id for s in spans}
    # the frontend's log line about the migration carries the request's ids
    lines = [r for r in jsonl(fe.stderr_text()) if "migrating" in r.get("message", "")]
    assert lines and lines[-1]["trace_id"] == trace_id and lines[-1]["span_id"] == server.span_id, lines


def test_jsonl_log_lines_carry_the_ids_of_the_span_they_were_logged_in(fleet, receiver):
    fe: DynamoRun = fleet["frontend"]
    header, trace_id, _ = traceparent()
    rid = "logs-" + secrets.token_hex(4)
    r = httpx.post(fe.api_url + "/chat/completions", timeout=30, headers={"traceparent": header, "x-request-id": rid},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    live = [(n, w) for n, w in fleet["workers"].items() if w.running]
    name, worker = next((n, w) for n, w in live if f"request {rid}" in w.stderr_text())
    spans = receiver.wait_for(trace_id, lambda ss: any(s.service == name and s.kind == "server" for s in ss),
                              15, "the worker's server span")
    worker_server = one(spans, service=name, kind="server")
    (line,) = [r for r in jsonl(worker.stderr_text()) if r.get("message", "").startswith(f"request {rid}:")]
    assert (line["trace_id"], line["span_id"]) == (trace_id, worker_server.span_id)
    # a line logged outside any request has none
    assert all("trace_id" not in r for r in jsonl(worker.stderr_text()) if "serving" in r.get("message", ""))


def test_tracing_off_imports_nothing_of_opentelemetry(tiny_model, receiver):
    """``PYTHONPROFILEIMPORTTIME`` lists every module a process imports: a request served with tracing off
    shows no OpenTelemetry module; the same with ``OTEL_EXPORT_ENABLED=true`` shows them (the check works)."""
    off = run_cli(["out=echo_core", str(tiny_model)], input="hello\n", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert off.returncode == 0 and "hello" in off.stdout, off.stderr
    assert "dynamo.cli.launch" in off.stderr and "opentelemetry" not in off.stderr
    on = run_cli(["out=echo_core", str(tiny_model)], input="hello\n",
                 env={"PYTHONPROFILEIMPORTTIME": "1", **exporter_env(receiver)})
    assert on.returncode == 0 and "hello" in on.stdout, on.stderr
    assert "opentelemetry.sdk.trace" in on.stderr
