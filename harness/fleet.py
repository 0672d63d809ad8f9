"""Starting a frontend of workers in a test and talking to it: workers started together, a KV-routing
frontend returned once it sees what the test needs; which models and instances it sees, its metrics (where it
had prompts prefilled), a stream whose worker is killed mid-way, chat requests with a request id, which worker served a request (from the workers' debug logs); and the command
line of a mocker worker that a planner or profiler starts."""

from __future__ import annotations

import json
import re
import socket
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

# a worker log level at which each request's id shows in the worker's stderr
WORKER_LOG = {"DYN_LOG": "info,dynamo.worker.handlers=debug"}
# the zero-infrastructure default: no etcd, no NATS, whatever the test runner's environment says
NO_INFRA_ENV = {"ETCD_ENDPOINTS": "", "NATS_SERVER": "", "DYN_DISCOVERY_BACKEND": "", "DYN_REQUEST_PLANE": "",
                "DYN_EVENT_PLANE": ""}


def infra_on_default_ports() -> bool:
    """An etcd or NATS answers on this machine's default ports (the default rule would then use it)."""
    for port in (2379, 4222):
        with socket.socket() as s:
            s.settimeout(0.3)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
    return False


def model_ids(frontend: DynamoRun) -> set[str]:
    resp = httpx.get(frontend.api_url + "/models", timeout=5)
    assert resp.status_code == 200, resp.text
    return {m["id"] for m in resp.json()["data"]}


def health_instances(frontend: DynamoRun, endpoint: str) -> set[int]:
    """Instance ids /health lists for ``endpoint`` (``dyn://ns.comp.ep``)."""
    resp = httpx.get(frontend.base_url + "/health", timeout=5)
    return {i["instance_id"] for i in resp.json().get("instances", []) if i["endpoint"] == endpoint}


def scrape(url: str, *, down_ok: bool = False) -> list[Sample]:
    """The samples a Prometheus endpoint serves; with ``down_ok``, none while it does not answer."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        if down_ok:
            return []
        raise
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric(frontend: DynamoRun, name: str, **labels: str) -> float:
    """One sample of the frontend's /metrics (0 when absent)."""
    for s in scrape(frontend.base_url + "/metrics"):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def mocker_worker_cmd(folder: Path, model_dir: Path, endpoint: str, model: str, engine_args: dict[str, Any]) -> str:
    """A mocker worker's command line serving ``model`` at ``endpoint`` (``ns.comp.ep``), its engine
    arguments written to ``folder/mocker.json``: what a planner or the profiler is told to start."""
    args_file = folder / "mocker.json"
    args_file.write_text(json.dumps(engine_args))
    return (f"{sys.executable} -m dynamo.cli in=dyn://{endpoint} out=mocker {model_dir} "
            f"--model-name {model} --extra-engine-args {args_file}")


def wait_for_model(frontend: DynamoRun, name: str, endpoint: str, instances: int, timeout: float = 15.0) -> None:
    try:
        wait_until(lambda: name in model_ids(frontend) and len(health_instances(frontend, endpoint)) >= instances,
                   timeout, f"model {name} with {instances} instance(s) of {endpoint} on the frontend")
    except pytest.fail.Exception as e:  # say what the frontend saw, for a failure that does not repeat
        try:
            seen = f"the frontend lists models {model_ids(frontend)}, instances of {endpoint}: " \
                   f"{health_instances(frontend, endpoint)}"
        except (httpx.HTTPError, AssertionError) as down:
            seen = f"the frontend does not answer ({down!r})"
        pytest.fail(f"{e}; {seen}; its log ends:\n{frontend.stderr_text()[-3000:]}")


def client_for(frontend: DynamoRun, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.api_url, api_key="unused", max_retries=0, timeout=timeout)


def request_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def served_by(workers: list[DynamoWorker], rid: str) -> list[DynamoWorker]:
    """The workers whose debug log shows request ``rid``."""
    needle = f"request {rid}"
    return [w for w in workers if needle in w.stderr_text()]


def chat(client: openai.OpenAI, model: str, content: str, *, stream: bool, rid: str | None = None,
         **kwargs: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one chat completion."""
    headers = {"x-request-id": rid} if rid else None
    messages: Any = [{"role": "user", "content": content}]
    if not stream:
        resp = client.chat.completions.create(model=model, messages=messages, extra_headers=headers, **kwargs)
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    parts, reason = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                extra_headers=headers, **kwargs):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(parts), reason


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


# -- starting a fleet ------------------------------------------------------------------------------------

def write_engine_args(path: Path, args: dict[str, Any]) -> Path:
    """``args`` as the JSON file a worker's ``--extra-engine-args`` names; returns ``path``."""
    path.write_text(json.dumps(args))
    return path


@contextmanager
def workers_running(workers: Sequence[DynamoWorker]) -> Iterator[list[DynamoWorker]]:
    """``workers`` started together and yielded once every one of them serves; all killed -9 on the way out
    (a crash: their leases expire by themselves, nothing waits for a graceful shutdown).

    All are started before any is awaited, so their model loads overlap: a fleet of llama.cpp workers
    costs the slowest one's start-up rather than the sum."""
    started = list(workers)
    try:
        for worker in started:
            worker.start(wait=False)
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.kill()


def health(frontend: DynamoRun) -> dict[str, Any]:
    """The frontend's ``/health`` document (its ``models`` and ``instances``)."""
    return httpx.get(frontend.base_url + "/health").json()


def sees_model(model: str, instances: int) -> Callable[[DynamoRun], bool]:
    """A frontend ``/health`` lists ``model`` and at least ``instances`` worker instances."""
    def check(frontend: DynamoRun) -> bool:
        doc = health(frontend)
        return model in doc.get("models", []) and len(doc.get("instances", [])) >= instances
    return check


def sees_instances(workers: Iterable[DynamoWorker], models: int = 1) -> Callable[[DynamoRun], bool]:
    """A frontend's ``/health`` lists every one of ``workers`` (by instance id) and ``models`` models."""
    want = {w.instance_id for w in workers}

    def check(frontend: DynamoRun) -> bool:
        doc = health(frontend)
        return want <= {i["instance_id"] for i in doc.get("instances", [])} and len(doc.get("models", [])) >= models
    return check


def read_kv_states(workers: int) -> Callable[[DynamoRun], bool]:
    """A KV-routing frontend logged the KV state of ``workers`` workers: its router knows what they hold,
    so a routing decision from now on sees the blocks cached before it started."""
    return lambda frontend: len(re.findall(r"KV state of worker", frontend.stderr_text())) >= workers


def dyn_frontend(env: dict[str, str], *flags: str, ready: Callable[[DynamoRun], Any], what: str,
                 timeout: float = 30.0) -> DynamoRun:
    """A started ``dynamo-run in=http out=dyn`` frontend, returned once ``ready(frontend)`` holds (stopped,
    and the test failed, when it does not within ``timeout`` s).

    Its HTTP port answers before discovery has shown it the workers; a request sent then would fail or
    be routed by a router that does not know them yet, so each test names what it must see first."""
    frontend = DynamoRun("out=dyn", *flags, env=env).start()
    try:
        wait_until(lambda: ready(frontend), timeout, what)
    except BaseException:
        frontend.stop()
        raise
    return frontend


def kv_frontend(env: dict[str, str], *flags: str, ready: Callable[[DynamoRun], Any], what: str,
                timeout: float = 30.0) -> DynamoRun:
    """:func:`dyn_frontend` with ``--router-mode kv``."""
    return dyn_frontend(env, "--router-mode", "kv", *flags, ready=ready, what=what, timeout=timeout)


def disagg_prefills(frontend: DynamoRun, model: str) -> dict[str, float]:
    """Where the frontend had ``model``'s prompts prefilled so far (``remote``, ``local``, ``fallback``), from
    its ``dynamo_frontend_disagg_prefill_total`` counters (0 for a place not used yet)."""
    out = {"remote": 0.0, "local": 0.0, "fallback": 0.0}
    for m in re.finditer(rf'disagg_prefill_total\{{model="{re.escape(model)}",where="(\w+)"\}} ([0-9.e+]+)',
                         httpx.get(frontend.base_url + "/metrics").text):
        out[m.group(1)] = float(m.group(2))
    return out


def stream_killing_its_worker(frontend: DynamoRun, model: str, prompt: str, workers: list[DynamoWorker], *,
                              after_chunks: int, rid: str, max_tokens: int = 40,
                              headers: dict[str, str] | None = None, timeout: float = 30,
                              before_kill: Callable[[DynamoWorker], None] | None = None,
                              ) -> tuple[list[dict[str, Any]], DynamoWorker, bool]:
    """Stream a chat completion of ``prompt`` (40 tokens, ``ignore_eos``) with request id ``rid``; once
    ``after_chunks`` content chunks have arrived, kill -9 the worker of ``workers`` that serves it.

    Returns (the parsed data events, the killed worker, whether the stream ended with ``[DONE]``): what a
    client sees of a worker crashing mid-stream, with migration on (the stream goes on elsewhere) or off
    (an error event).  The serving worker is found from its debug log (:data:`WORKER_LOG`); ``before_kill``
    is called with it first (a test waiting for what the worker has exported so far)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    events: list[dict[str, Any]] = []
    victim = None
    done = False
    with httpx.stream("POST", frontend.api_url + "/chat/completions", json=body, timeout=timeout,
                      headers={"x-request-id": rid, **(headers or {})}) as resp:
        assert resp.status_code == 200
        for data in sse_events(resp):
            if data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
            content = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
            if victim is None and len(content) >= after_chunks:
                victim = wait_until(lambda: served_by(workers, rid), 5, f"the worker serving {rid}")[0]
                if before_kill is not None:
                    before_kill(victim)
                victim.kill()
    assert victim is not None, "stream ended before the worker could be killed"
    return events, victim, done
