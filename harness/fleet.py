"""Talking to a frontend of workers in a test: which models and instances it sees, chat requests with a
request id, which worker served a request (from the workers' debug logs)."""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import httpx
import openai

from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

# a worker log level at which each request's id shows in the worker's stderr
WORKER_LOG = {"DYN_LOG": "info,dynamo.worker.handlers=debug"}


def model_ids(frontend: DynamoRun) -> set[str]:
    resp = httpx.get(frontend.api_url + "/models", timeout=5)
    assert resp.status_code == 200, resp.text
    return {m["id"] for m in resp.json()["data"]}


def health_instances(frontend: DynamoRun, endpoint: str) -> set[int]:
    """Instance ids /health lists for ``endpoint`` (``dyn://ns.comp.ep``)."""
    resp = httpx.get(frontend.base_url + "/health", timeout=5)
    return {i["instance_id"] for i in resp.json().get("instances", []) if i["endpoint"] == endpoint}


def wait_for_model(frontend: DynamoRun, name: str, endpoint: str, instances: int, timeout: float = 15.0) -> None:
    wait_until(lambda: name in model_ids(frontend) and len(health_instances(frontend, endpoint)) >= instances,
               timeout, f"model {name} with {instances} instance(s) of {endpoint} on the frontend")


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
