"""A real vLLM worker's KV events reach a real KV router: ``dynamo-run in=dyn://... out=vllm`` behind
``in=http out=dyn --router-mode kv``, with real etcd and nats-server.

The worker turns on vLLM's own ZMQ KV-event publisher, rehashes the blocks vLLM stores into the router's
format and publishes them on the event plane (NATS here).  The router's decision events (topic ``kv-hit-rate``) show
whether it found the prompt cached on the worker: with one worker the choice is forced, so a non-zero
``overlap_blocks`` can only come from the worker's events.  The response's
``usage.prompt_tokens_details.cached_tokens`` is vLLM's own count of the prefix it reused, carried back
over ``out=dyn``; the two should agree.  Load metrics come from vLLM's scheduler stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import nats
import pytest

from dynamo.engines.vllm import engine as vl
from dynamo.kv.hashing import compute_block_hashes
from dynamo.kv.indexer import KvIndexer
from dynamo.kv.v1_events import metrics_from_load
from dynamo.kv.zmq_events import KvEventSink, KvEventTranslator, ZmqKvEventSubscriber
from dynamo.llm.model_card import ModelCard
from dynamo.run_config import RunConfig
from dynamo.runtime.v1_event_wire import decode_envelope
from harness.events import kv_events, nats_subject, payload
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, kv_frontend, running, vllm_cache_env, vllm_tier, words

pytestmark = vllm_tier()

NS = "vkv"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32


@pytest.fixture(scope="module")
def worker(servers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoWorker]:
    model = build_tiny_hf_model(tmp_path_factory.mktemp("vllm-kv-models"))
    cache = tmp_path_factory.mktemp("vllm-kv-cache")
    env = {**servers, **vllm_cache_env(cache),
           "DYN_LOG": "info,dynamo.engines.vllm.engine=debug,dynamo.kv.zmq_events=debug"}
    with running(DynamoWorker(f"in=dyn://{NS}.vllm.generate", "out=vllm", str(model), "--model-name", NS,
                              "--context-length", "1024", "--kv-cache-block-size", str(BLOCK), env=env,
                              startup_timeout=STARTUP_TIMEOUT)) as w:
        yield w


@pytest.fixture(scope="module")
def frontend(servers: dict[str, str], worker: DynamoWorker) -> Iterator[DynamoRun]:
    def sees_worker(fe: DynamoRun) -> bool:
        health = httpx.get(fe.base_url + "/health").json()
        return worker.instance_id in {i["instance_id"] for i in health.get("instances", [])}

    with kv_frontend(servers, sees_worker, "the frontend to see the vLLM worker") as fe:
        yield fe


async def _run(servers: dict[str, str], fe: DynamoRun, worker: DynamoWorker) -> dict[str, Any]:
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    stored: list[dict[str, Any]] = []
    got_stored = asyncio.Event()
    metrics: list[dict[str, Any]] = []

    async def on_decision(msg: Any) -> None:
        decisions.put_nowait(payload(msg.data))

    async def on_kv(msg: Any) -> None:
        for event in kv_events(msg.data):
            if isinstance(event["event"]["data"], dict) and "stored" in event["event"]["data"]:
                stored.append(event)
                got_stored.set()

    hit_rate_seen = asyncio.Event()

    async def on_metrics(msg: Any) -> None:
        m = metrics_from_load(decode_envelope(msg.data).payload)
        metrics.append(m)
        if m["data"]["kv_stats"]["gpu_prefix_cache_hit_rate"] > 0:
            hit_rate_seen.set()

    await nc.subscribe(nats_subject(NS, "kv-hit-rate"), cb=on_decision)
    await nc.subscribe(nats_subject(NS, "kv-events", "vllm"), cb=on_kv)
    await nc.subscribe(nats_subject(NS, "kv_metrics", "vllm"), cb=on_metrics)
    await nc.flush()
    prompt = words(150, 1)  # a few hundred tokens: many blocks
    results: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            async def send(text: str, stream: bool = False) -> dict[str, Any]:
                body = {"model": NS, "prompt": text, "max_tokens": 4, "temperature": 0}
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                    usage = None
                    async with client.stream("POST", fe.api_url + "/completions", json=body) as resp:
                        assert resp.status_code == 200
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                usage = chunk.get("usage") or usage
                    return {"usage": usage}
                resp = await client.post(fe.api_url + "/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()

            first = await send(prompt + " first")
            results["first"] = (first["usage"], await asyncio.wait_for(decisions.get(), 10))
            await asyncio.wait_for(got_stored.wait(), 30)  # vLLM's events for the first prompt reached NATS
            # events travel asynchronously: send until the router sees the prefix (a few tries at most)
            for _ in range(20):
                again = await send(prompt + " again", stream=True)
                decision = await asyncio.wait_for(decisions.get(), 10)
                if decision["overlap_blocks"] > 0:
                    break
                await asyncio.sleep(0.2)
            results["again"] = (again["usage"], decision)
        # the worker publishes load metrics when they change, on its own schedule: wait for the one that
        # carries the reuse (the test's last assertion says so if it never comes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hit_rate_seen.wait(), 10)
    finally:
        await nc.close()
    results["stored"] = stored
    results["metrics"] = metrics
    return results


def test_vllm_kv_events_reach_the_router_and_usage_reports_the_reuse(servers, worker, frontend):
    r = asyncio.run(_run(servers, frontend, worker))
    usage1, decision1 = r["first"]
    assert decision1["worker_id"] == worker.instance_id and decision1["overlap_blocks"] == 0
    assert decision1["isl_blocks"] >= 10, decision1
    # vLLM reports what it reused (nothing yet, beyond what earlier tests might have left: a fresh prompt)
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
    # the worker's events are in the router's format: its own id, our hashes
    assert all(e["worker_id"] == worker.instance_id for e in r["stored"])
    blocks = [b for e in r["stored"] for b in e["event"]["data"]["stored"]["blocks"]]
    assert len(blocks) >= decision1["isl_blocks"]
    usage2, decision2 = r["again"]
    print(f"\nfirst: {decision1} {usage1}\nagain: {decision2} {usage2}\n{len(blocks)} blocks stored, "
          f"{len(r['metrics'])} metrics messages, last {r['metrics'][-1] if r['metrics'] else None}")
    # the router found the shared prefix cached on the worker, from vLLM's events alone ...
    assert decision2["overlap_blocks"] >= decision1["isl_blocks"] - 2, decision2
    # ... and vLLM did reuse it: its own count, carried back through out=dyn in the streamed usage
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (decision2["overlap_blocks"] - 1) * BLOCK, (usage2, decision2)
    # load metrics from vLLM's scheduler stats, in the mocker's shape
    assert r["metrics"], "no load metrics published"
    kv = r["metrics"][-1]["data"]["kv_stats"]
    assert r["metrics"][-1]["worker_id"] == worker.instance_id and kv["kv_total_blocks"] > 0
    assert any(m["data"]["kv_stats"]["gpu_prefix_cache_hit_rate"] > 0 for m in r["metrics"])


# -- the socket and the engine's wiring, without starting vLLM ----------------------------------------

def _stored_batch(tokens: list[int], block: int) -> bytes:
    import msgspec

    event = {"type": "BlockStored", "block_hashes": [b"h%d" % i for i in range(len(tokens) // block)],
             "parent_block_hash": None, "token_ids": tokens, "block_size": block, "lora_id": None,
             "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([0.0, [event], 0])


async def _publish_until(endpoint: str, payload: bytes, seen: Any) -> None:
    """Connect a PUB socket as vLLM's engine core does (an endpoint without '*' is connected to) and send
    until the subscriber has it: PUB/SUB drops what is sent before the connection is up."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)
    try:
        for seq in range(250):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            await asyncio.sleep(0.02)
            if seen():
                return
        raise AssertionError("the subscriber never got the batch")
    finally:
        pub.close(linger=0)
        ctx.term()


async def test_zmq_subscriber_feeds_the_router_format():
    indexer, sent = KvIndexer(), []

    def publish(event: dict[str, Any]) -> None:
        sent.append(event)
        assert indexer.apply_event(event)

    sub = ZmqKvEventSubscriber(KvEventSink(KvEventTranslator(4), 77, publish))
    endpoint = sub.bind()
    assert endpoint.startswith("tcp://127.0.0.1:")
    sub.start()
    try:
        tokens = list(range(100, 112))
        await _publish_until(endpoint, _stored_batch(tokens, 4), lambda: sent)
        assert indexer.find_matches(compute_block_hashes(tokens, 4)) == {77: 3}
    finally:
        await sub.close()


async def test_engine_wiring_for_a_dyn_worker(tmp_path: Path):
    """What VllmEngine does around vLLM's start for an in=dyn:// worker: the socket is bound before, the
    config and stat logger go to vLLM, the block size comes from vLLM's config, attach() names the worker."""
    cfg = RunConfig(output="vllm", input="dyn://ns.vllm.generate")
    engine = vl.VllmEngine(cfg, ModelCard(display_name="tiny", path=tmp_path, kv_cache_block_size=16))
    engine._prepare_kv_events()
    try:
        assert engine._kv_sub is not None and engine._metrics is not None
        engine._llm = SimpleNamespace(vllm_config=SimpleNamespace(
            cache_config=SimpleNamespace(num_gpu_blocks=500, enable_prefix_caching=True, block_size=32),
            scheduler_config=SimpleNamespace(max_num_seqs=8)))
        engine.card.kv_cache_block_size = 32  # what _adopt_engine_config takes from vLLM
        engine._start_kv_events()
        events: list[dict[str, Any]] = []
        metrics: list[dict[str, Any]] = []
        engine.attach(4242, publish_kv_event=events.append, publish_metrics=metrics.append)
        await _publish_until(engine._kv_sub.endpoint, _stored_batch(list(range(64)), 32), lambda: events)
        assert events[0]["worker_id"] == 4242 and len(events[0]["event"]["data"]["stored"]["blocks"]) == 2
        engine._metrics.factory(None, 0).record(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0,
                                                                kv_cache_usage=0.1, prefix_cache_stats=None))
        assert metrics and metrics[-1]["worker_id"] == 4242
        assert engine.load_metrics()["kv_stats"]["kv_total_blocks"] == 500
        assert engine.all_load_metrics()[0]["worker_stats"]["request_total_slots"] == 8
    finally:
        engine._llm = None
        await engine.close()
