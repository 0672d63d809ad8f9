"""Offloaded blocks steer the KV router, with real llama.cpp workers on real etcd and NATS.

Worker A (one slot, a host-memory tier) computes a long prompt, then another one that pushes the first
out of its slot into host memory: A announces those blocks as ``host_pinned``.  Worker B (one slot, no
tier) holds the first block of that prompt, resident.  The same long prompt again goes to A, which
restores it instead of recomputing it; a router blind to tiers would pick B (one resident block against
none).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import pytest

from harness.events import kv_events, nats_subject, payload
from harness.fleet import kv_frontend, read_kv_states, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import etcd_and_nats_env
from harness.wait import until
from tests.integration.test_kv_routing import frontend_caught_up, text

pytestmark = pytest.mark.timeout(240)
MODEL = "tierllama"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env() as env:
        yield env


def _worker(servers: dict[str, str], gguf: Path, args_file: Path, args: dict[str, Any]) -> DynamoWorker:
    write_engine_args(args_file, args)
    return DynamoWorker(f"in=dyn://{MODEL}.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name", MODEL,
                        "--context-length", "512", "--extra-engine-args", str(args_file),
                        env={**servers, "DYN_LOG": "info,dynamo.engines.llamacpp=debug"}, startup_timeout=120)


async def _complete(fe: DynamoRun, prompt: str, worker: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "nvext": {"ignore_eos": True}}
    if worker is not None:
        body["nvext"]["backend_instance_id"] = worker
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(fe.api_url + "/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _scenario(servers: dict[str, str], fe: DynamoRun, a: DynamoWorker, b: DynamoWorker) -> None:
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: list[dict[str, Any]] = []
    offloaded = asyncio.Event()
    b_stored = asyncio.Event()

    async def on_event(msg: Any) -> None:
        for e in kv_events(msg.data):
            on_kv(e)

    def on_kv(e: dict[str, Any]) -> None:
        data = e["event"]["data"]
        if isinstance(data, dict) and "stored" in data:
            if e["worker_id"] == a.instance_id and e.get("storage_tier") == "host_pinned":
                offloaded.set()
            if e["worker_id"] == b.instance_id and e.get("storage_tier") == "device":
                b_stored.set()

    async def on_decision(msg: Any) -> None:
        decisions.append(payload(msg.data))

    try:
        await nc.subscribe(nats_subject(MODEL, "kv-events", "llamacpp", "generate"), cb=on_event)
        await nc.subscribe(nats_subject(MODEL, "kv-hit-rate"), cb=on_decision)
        await nc.flush()
        long_prompt = text(90)
        await _complete(fe, long_prompt, worker=a.instance_id)
        await _complete(fe, text(60), worker=a.instance_id)  # pushes the long prompt out of A's only slot
        await asyncio.wait_for(offloaded.wait(), 10)
        await _complete(fe, " ".join(long_prompt.split()[:12]), worker=b.instance_id)  # B: its first block
        await asyncio.wait_for(b_stored.wait(), 10)
        # the frontend's router has the same events (those this subscription got before the marker)
        await frontend_caught_up(nc, fe, nats_subject(MODEL, "kv-events", "llamacpp", "generate"))
        decisions.clear()
        out = await _complete(fe, long_prompt)
        await until(lambda: decisions, 10, "the router's decision")
        (decision,) = decisions
        assert decision["worker_id"] == a.instance_id, decision
        assert decision["overlap_blocks"] == 0  # nothing resident on A: the host tier won it
        # and A restored the prefix instead of computing it
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= out["usage"]["prompt_tokens"] - 48
        assert re.search(r"restored \d+ cached tokens from the host tier", a.stderr_text())
    finally:
        await nc.close()


def test_a_prefix_offloaded_on_a_worker_brings_its_request_back_there(gguf, servers, tmp_path):
    a = _worker(servers, gguf, tmp_path / "a.json", {"n_parallel": 1, "n_threads": 1, "host_cache_mb": 64})
    b = _worker(servers, gguf, tmp_path / "b.json", {"n_parallel": 1, "n_threads": 1})
    with workers_running([a, b]):
        with kv_frontend(servers, ready=read_kv_states(2), what="the frontend to read both workers' KV state") as fe:
            asyncio.run(_scenario(servers, fe, a, b))
