"""Workers lending cached prefixes, in a fleet: real llama.cpp workers started with
``DYN_KV_PREFIX_SHARING=1``, real etcd and NATS, our KV router.

Worker A computes a long shared prompt (and keeps the finished turn in its host tier) and is then kept
busy generating, with a long prompt of another to compute next; the same prompt's next request goes to
idle worker B, which fetches the prefix's KV from A's host memory instead of computing it or waiting for
A's prefill (the router names A in the request; B's usage reports the prefix cached).  With A stopped (SIGSTOP) while holding another
prefix, B's fetch gives up after ``DYN_KV_PREFIX_FETCH_TIMEOUT`` and B computes the prompt: the client
gets its answer either way.
"""

from __future__ import annotations

import asyncio
import os
import signal
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
from tests.integration.test_kv_routing import frontend_caught_up, gauge

pytestmark = pytest.mark.timeout(300)
MODEL = "sharellama"
SUBJECT = nats_subject(MODEL, "kv-events", "llamacpp", "generate")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env() as env:
        yield env


def _worker(servers: dict[str, str], gguf: Path, args_file: Path) -> DynamoWorker:
    write_engine_args(args_file, {"n_parallel": 2, "n_threads": 1})
    return DynamoWorker(f"in=dyn://{MODEL}.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name", MODEL,
                        "--context-length", "1024", "--extra-engine-args", str(args_file),
                        env={**servers, "DYN_KV_PREFIX_FETCH_TIMEOUT": "1", "DYN_KV_PREFIX_SHARING": "1",
                             "DYN_LOG": "info,dynamo.disagg.prefix_share=debug"}, startup_timeout=120)


def system(topic: str) -> str:
    return (f"You are the help desk of a {topic}. Answer in one short sentence, politely, and say so when "
            "you do not know. ") * 4


async def complete(client: httpx.AsyncClient, fe: DynamoRun, prompt: str, worker: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                            "nvext": {"ignore_eos": True}}
    if worker is not None:
        body["nvext"]["backend_instance_id"] = worker
    resp = await client.post(fe.api_url + "/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def keep_busy(client: httpx.AsyncClient, fe: DynamoRun, a: DynamoWorker, busy: list[asyncio.Task[Any]]) -> None:
    """A long streamed answer to a long prompt on A, and once it is decoding another long prompt there,
    whose prefill is ahead of anything sent to A next (a holder only decoding keeps the prompts it holds:
    a fetch would cost more than waiting a token per step); returns once the router has booked that
    prefill on A. The streams' tasks go into ``busy``."""
    started = asyncio.Event()

    async def stream(prompt: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "nvext": {"ignore_eos": True, "backend_instance_id": a.instance_id}}
        async with client.stream("POST", fe.api_url + "/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    started.set()

    counting = "Here are some numbers: " + ", ".join(map(str, range(60))) + ". Now count on:"
    busy.append(asyncio.create_task(stream(counting, 600)))
    await asyncio.wait_for(started.wait(), 60)
    letters = "Here are some letters: " + ", ".join(f"{c}{i}" for i in range(90) for c in "xy") + "."
    busy.append(asyncio.create_task(stream(letters, 2)))

    async def prefill_booked_on_a() -> bool:
        metrics = (await client.get(fe.base_url + "/metrics")).text
        return (gauge(metrics, "worker_active_prefill_tokens", MODEL, a.instance_id) or 0) > 0

    await until(prefill_booked_on_a, 10, "the router to book A's long prefill")


async def _scenario(servers: dict[str, str], fe: DynamoRun, a: DynamoWorker, b: DynamoWorker) -> None:
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: list[dict[str, Any]] = []
    a_stored = asyncio.Event()

    async def on_event(msg: Any) -> None:
        for e in kv_events(msg.data):
            on_kv(e)

    def on_kv(e: dict[str, Any]) -> None:
        data = e.get("event", {}).get("data")
        # the finished turn, kept in A's host tier (a lender's): what B fetches without waiting for A
        if (e.get("worker_id") == a.instance_id and isinstance(data, dict) and "stored" in data
                and e.get("storage_tier") == "host_pinned"):
            a_stored.set()

    async def on_decision(msg: Any) -> None:
        decisions.append(payload(msg.data))

    async with httpx.AsyncClient(timeout=120) as client:
        busy: list[asyncio.Task[Any]] = []

        try:
            await nc.subscribe(SUBJECT, cb=on_event)
            await nc.subscribe(nats_subject(MODEL, "kv-hit-rate"), cb=on_decision)
            await nc.flush()
            # A computes the bookshop's system prompt
            shop = system("bookshop")
            await complete(client, fe, shop + "When do you open?", worker=a.instance_id)
            await asyncio.wait_for(a_stored.wait(), 10)
            await frontend_caught_up(nc, fe, SUBJECT)
            await keep_busy(client, fe, a, busy)
            decisions.clear()
            out = await complete(client, fe, shop + "Do you sell maps?")
            await until(lambda: decisions, 10, "the router's decision")
            assert decisions[-1]["worker_id"] == b.instance_id, decisions  # the idle worker
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= out["usage"]["prompt_tokens"] - 32  # the prefix came from A, not computed on B
            await until(lambda: "KV prefix of" in b.stderr_text(), 10, "B's fetch in its log")

            # A holds the garage's prompt, and stops answering (SIGSTOP) while busy: B's fetch gives up
            garage = system("garage")
            a_stored.clear()
            for task in busy:
                task.cancel()
            await complete(client, fe, garage + "Can you fix brakes?", worker=a.instance_id)
            await asyncio.wait_for(a_stored.wait(), 10)
            await frontend_caught_up(nc, fe, SUBJECT)
            await keep_busy(client, fe, a, busy)
            os.kill(a.pid, signal.SIGSTOP)
            try:
                decisions.clear()
                out = await asyncio.wait_for(complete(client, fe, garage + "Do you rent cars?"), 60)
                assert decisions[-1]["worker_id"] == b.instance_id
                assert out["choices"][0]["text"] and out["usage"]["prompt_tokens_details"]["cached_tokens"] < 32
                await until(lambda: "no KV prefix from" in b.stderr_text(), 10, "B's failed fetch in its log")
            finally:
                os.kill(a.pid, signal.SIGCONT)
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            await nc.close()


def test_an_idle_worker_fetches_the_busy_holders_prefix_and_survives_a_stopped_one(gguf, servers, tmp_path):
    a = _worker(servers, gguf, tmp_path / "a.json")
    b = _worker(servers, gguf, tmp_path / "b.json")
    with workers_running([a, b]):
        with kv_frontend({**servers, "DYN_ROUTER_LOG": str(tmp_path / "decisions.jsonl")}, ready=read_kv_states(2),
                         what="the frontend to read both workers' KV state") as fe:
            asyncio.run(_scenario(servers, fe, a, b))
