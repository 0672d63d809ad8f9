"""KV events between Dynamo 1.6.1's mocker and our KV router, on 1.x's event plane (ZMQ and NATS), with
etcd discovery (keys as 1.6.1 writes them: plain): the blocks its mocker stores for a prompt are the ones our
router finds for that prompt's token ids, and its load reaches us."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest

from dynamo.kv import KvRouter
from dynamo.kv.v1_events import TOPIC_KV_EVENTS, TOPIC_KV_METRICS, decode_router_events, metrics_from_load
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings
from dynamo.runtime.v1_event_wire import EndpointScope
from harness.dynamo1x import d16_env, d16_frontend, d16_mocker
from harness.wait import until

BLOCK = 64  # 1.6.1's mocker's


@pytest.mark.parametrize("plane", ["zmq", "nats"])
async def test_our_router_finds_the_1x_mocker_s_blocks(tiny_chat_5k: Path, etcd_server, nats_server, plane: str) -> None:
    ns = f"k{uuid.uuid4().hex[:8]}"
    extra = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd_server.url, "DYN_EVENT_PLANE": plane}
    if plane == "nats":
        extra["NATS_SERVER"] = nats_server.url
    env = d16_env(None, extra)
    settings = RuntimeSettings(etcd=EtcdSettings([etcd_server.url]), nats=NatsSettings(nats_server.url))
    settings.event_plane = plane
    rt = await DistributedRuntime.connect(settings)
    router = KvRouter(block_size=BLOCK)
    loads: list[dict] = []
    workers: set[int] = set()

    def on_events(env) -> None:
        for event in decode_router_events(env.payload):
            workers.add(event["worker_id"])
            router.apply_event(event)

    try:
        plane_1x = rt.event_plane()
        scope = EndpointScope(ns, "backend", "generate")
        subs = [await plane_1x.subscribe(scope, TOPIC_KV_EVENTS, on_events),
                await plane_1x.subscribe(scope, TOPIC_KV_METRICS,
                                         lambda env: loads.append(metrics_from_load(env.payload)))]
        with d16_mocker(tiny_chat_5k, f"dyn://{ns}.backend.generate", env, "--speedup-ratio", "0"), \
                d16_frontend(env, "--router-mode", "kv", model="tiny-chat") as frontend:
            # events published before our subscriptions reach the mocker are lost (a router recovers them)
            await until(lambda: plane_1x.reconnects >= 2 if plane == "zmq" else all(s.on_nats for s in subs), 30,
                        "our subscriptions to the mocker's streams")
            attempt = 0
            prompt: list[int] = []
            async with httpx.AsyncClient(timeout=30) as http:
                async def sent_and_seen() -> bool:  # a new prompt each time: a repeat stores nothing new
                    nonlocal attempt, prompt
                    attempt += 1
                    prompt = [1000 + (i * 37 + attempt) % 3000 for i in range(5 * BLOCK + 10)]
                    reply = await http.post(f"{frontend.url}/v1/completions",
                                            json={"model": "tiny-chat", "prompt": prompt, "max_tokens": 2})
                    assert reply.status_code == 200, reply.text
                    await asyncio.sleep(0.3)
                    return workers and router.find_matches(prompt) == {w: 5 for w in workers}

                await until(sent_and_seen, 30, "the 1.6.1 mocker's KV events in our router", interval=0.5)
                (worker,) = workers
                assert router.select(prompt, [worker, 12345]).worker_id == worker
                await until(lambda: any(m["worker_id"] == worker for m in loads), 10, "its kv_metrics")
    finally:
        await rt.close()
