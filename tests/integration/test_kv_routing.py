"""KV-aware routing end to end: mocker workers (``in=dyn://... out=mocker``) publish KV events over a real
nats-server, a frontend (``in=http out=dyn --router-mode kv``) routes by them, found through a real etcd.

Which worker a request went to, and how many of its prompt blocks the router thought were cached there,
is read from the router's decisions on NATS ``namespace.<ns>.kv-hit-rate``
(``{"worker_id", "isl_blocks", "overlap_blocks"}``), which the test subscribes to with nats-py.

Two workers per model: ``kvev`` (shared by the KV-events frontend and the ``--use-kv-events false``
frontend, each test with its own prompts) and ``kvkill`` (one of them is killed -9).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import pytest

from tests.support.proc import DynamoRun, DynamoWorker
from tests.support.servers import EtcdServer, NatsServer

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 16
NUM_BLOCKS = 512
MOCKER_ARGS = {"num_gpu_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "speedup_ratio": 20.0}


# -- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}


@pytest.fixture(scope="module")
def workers(servers, tiny_model: Path, tmp_path_factory) -> Iterator[dict[str, list[DynamoWorker]]]:
    args_file = tmp_path_factory.mktemp("mocker") / "mocker.json"
    args_file.write_text(json.dumps(MOCKER_ARGS))
    fleet: dict[str, list[DynamoWorker]] = {}
    try:
        for ns in ("kvev", "kvkill"):
            fleet[ns] = [DynamoWorker(f"in=dyn://{ns}.mocker.generate", "out=mocker", str(tiny_model),
                                      "--model-name", ns, "--extra-engine-args", str(args_file),
                                      env=servers).start(wait=False) for _ in range(2)]
        for ws in fleet.values():
            for w in ws:
                w.wait_ready()
        yield fleet
    finally:
        for ws in fleet.values():
            for w in ws:
                w.kill()


def _frontend(servers: dict[str, str], workers, *flags: str) -> DynamoRun:
    fe = DynamoRun("out=dyn", "--router-mode", "kv", *flags, env=servers).start()
    deadline = time.monotonic() + 30
    want = {w.instance_id for ws in workers.values() for w in ws}
    while time.monotonic() < deadline:
        health = httpx.get(fe.base_url + "/health").json()
        if want <= {i["instance_id"] for i in health.get("instances", [])} and len(health.get("models", [])) >= 2:
            return fe
        time.sleep(0.05)
    fe.stop()
    raise AssertionError(f"frontend did not see the workers: {health}")


@pytest.fixture(scope="module")
def frontend(servers, workers) -> Iterator[DynamoRun]:
    fe = _frontend(servers, workers)
    try:
        yield fe
    finally:
        fe.stop()


@pytest.fixture(scope="module")
def approx_frontend(servers, workers) -> Iterator[DynamoRun]:
    fe = _frontend(servers, workers, "--use-kv-events", "false")
    try:
        yield fe
    finally:
        fe.stop()


# -- helpers -----------------------------------------------------------------------------------------

_rng = random.Random(5)


def text(words: int) -> str:
    """A prompt nobody else sends (a few hundred tokens for 100 words)."""
    return " ".join("".join(_rng.choice("abcdefghij") for _ in range(5)) for _ in range(words))


async def _send(client: httpx.AsyncClient, fe: DynamoRun, model: str, prompt: str) -> None:
    resp = await client.post(fe.api_url + "/completions",
                             json={"model": model, "prompt": prompt, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


async def _routed(servers: dict[str, str], fe: DynamoRun, ns: str, prompts: list[str]) -> list[dict[str, Any]]:
    """Send ``prompts`` at once; the router's decisions published meanwhile, in order."""
    nc = await nats.connect(servers["NATS_SERVER"])
    events: list[dict[str, Any]] = []

    async def on_event(msg: Any) -> None:
        events.append(json.loads(msg.data))

    try:
        await nc.subscribe(f"namespace.{ns}.kv-hit-rate", cb=on_event)
        await nc.flush()
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(_send(client, fe, ns, p) for p in prompts))
        await nc.flush()
        await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return events


def routed(servers: dict[str, str], fe: DynamoRun, ns: str, *prompts: str) -> list[dict[str, Any]]:
    return asyncio.run(_routed(servers, fe, ns, list(prompts)))


def route_until_cached(servers, fe, ns: str, prompt: str, tries: int = 10) -> dict[str, Any]:
    """Send ``prompt`` until the router sees part of it cached (KV events travel asynchronously)."""
    for _ in range(tries):
        (event,) = routed(servers, fe, ns, prompt)
        if event["overlap_blocks"] > 0:
            return event
        time.sleep(0.1)
    raise AssertionError(f"no cached prefix found for the prompt after {tries} tries; last decision {event}")


def scrape(fe: DynamoRun) -> str:
    return httpx.get(fe.base_url + "/metrics").text


def gauge(metrics: str, name: str, model: str, worker_id: int) -> float | None:
    pattern = (rf'^dynamo_frontend_{name}\{{(?=[^}}]*model="{model}")(?=[^}}]*worker_id="{worker_id}")'
               rf'(?=[^}}]*dp_rank="0")[^}}]*\}} (\S+)$')
    m = re.search(pattern, metrics, re.M)
    return float(m.group(1)) if m else None


# -- tests -------------------------------------------------------------------------------------------

def test_shared_prefix_goes_to_the_worker_that_caches_it(servers, workers, frontend):
    prefix = text(120)
    (first,) = routed(servers, frontend, "kvev", prefix + " " + text(10))
    assert first["overlap_blocks"] == 0
    assert first["isl_blocks"] > 20
    second = route_until_cached(servers, frontend, "kvev", prefix + " " + text(10))
    assert second["worker_id"] == first["worker_id"]
    # the prefix is most of the prompt: nearly all of its blocks were found
    assert second["overlap_blocks"] >= first["isl_blocks"] - 4

    # the frontend's /metrics show both workers' load, and the hit on the first one
    ids = {w.instance_id for w in workers["kvev"]}
    assert first["worker_id"] in ids
    deadline = time.monotonic() + 5
    while True:
        metrics = scrape(frontend)
        totals = {i: gauge(metrics, "worker_kv_total_blocks", "kvev", i) for i in ids}
        hit = gauge(metrics, "worker_prefix_cache_hit_rate", "kvev", first["worker_id"])
        if all(v == NUM_BLOCKS for v in totals.values()) and hit:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"per-worker gauges missing or wrong: totals {totals}, hit rate {hit}\n"
                                 + "\n".join(l for l in metrics.splitlines() if "worker_" in l))
        time.sleep(0.1)
    assert 0 < hit <= 1
    # Dynamo 1.x's names: the KV router's count of the blocks and prompt tokens it sent (idle now: 0),
    # and the last request's timing on the worker that served it
    for name in ("worker_active_decode_blocks", "worker_active_prefill_tokens", "worker_kv_cache_usage_ratio",
                 "worker_requests_waiting", "worker_request_active_slots", "worker_request_total_slots"):
        for i in ids:
            assert gauge(metrics, name, "kvev", i) is not None, (name, i)
    assert gauge(metrics, "worker_active_decode_blocks", "kvev", first["worker_id"]) == 0
    assert gauge(metrics, "worker_last_input_sequence_tokens", "kvev", first["worker_id"]) > 100
    assert gauge(metrics, "worker_last_time_to_first_token_seconds", "kvev", first["worker_id"]) > 0


def test_cached_tokens_reach_the_client_through_out_dyn(servers, workers, frontend):
    """The mocker reports its prefix hit; it travels in the worker's items and ends up in OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, unary and streamed, matching what the router expected."""
    prefix = text(120)
    routed(servers, frontend, "kvev", prefix + " " + text(10))
    decision = route_until_cached(servers, frontend, "kvev", prefix + " " + text(10))
    body = {"model": "kvev", "prompt": prefix + " " + text(10), "max_tokens": 2}
    unary = httpx.post(frontend.api_url + "/completions", json=body, timeout=30).json()["usage"]
    # the mocker counts whole cached blocks; the router saw about as many (this prompt's tail differs)
    cached = unary["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK_SIZE == 0 and cached >= (decision["overlap_blocks"] - 1) * BLOCK_SIZE, (unary, decision)
    assert cached < unary["prompt_tokens"]
    def chat_usage() -> dict[str, Any]:
        with httpx.stream("POST", frontend.api_url + "/chat/completions", timeout=30, json={
                "model": "kvev", "messages": [{"role": "user", "content": prefix}], "max_tokens": 2,
                "stream": True, "stream_options": {"include_usage": True}}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"] == []
        return chunks[-1]["usage"]

    assert chat_usage()["prompt_tokens_details"]["cached_tokens"] >= 0  # a new chat prompt
    # the same chat again goes back to the worker that has all of its complete blocks now (once the KV
    # events got to the router: they travel beside the response, so allow a few tries)
    for _ in range(10):
        usage = chat_usage()
        if usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] - BLOCK_SIZE:
            break
        time.sleep(0.1)
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] - BLOCK_SIZE, usage


def test_approximate_indexer_without_kv_events(servers, workers, approx_frontend):
    prefix = text(120)
    (first,) = routed(servers, approx_frontend, "kvev", prefix + " " + text(10))
    # no events needed: the router assumes what it routed is cached, at once
    (second,) = routed(servers, approx_frontend, "kvev", prefix + " " + text(10))
    assert second["worker_id"] == first["worker_id"]
    assert second["overlap_blocks"] >= first["isl_blocks"] - 4


def test_distinct_prompts_spread_over_both_workers(servers, workers, frontend):
    events = routed(servers, frontend, "kvev", *(text(60) for _ in range(20)))
    assert len(events) == 20
    counts = {w.instance_id: 0 for w in workers["kvev"]}
    for e in events:
        counts[e["worker_id"]] += 1
    assert min(counts.values()) >= 6, counts


def test_killed_worker_is_routed_around(servers, workers, frontend):
    prefix = text(120)
    (first,) = routed(servers, frontend, "kvkill", prefix + " " + text(10))
    victim = next(w for w in workers["kvkill"] if w.instance_id == first["worker_id"])
    survivor = next(w for w in workers["kvkill"] if w is not victim)
    victim.kill()
    # the router still thinks the dead worker has the prefix; the request finds no responder there and
    # is routed again, now without the dead worker
    events = routed(servers, frontend, "kvkill", prefix + " " + text(10))
    assert events[-1]["worker_id"] == survivor.instance_id
    # the survivor now caches the prefix: later requests follow it there
    again = route_until_cached(servers, frontend, "kvkill", prefix + " " + text(10))
    assert again["worker_id"] == survivor.instance_id
    # once the dead worker's lease expires its entry goes, and with it its blocks and its series
    deadline = time.monotonic() + 20
    while gauge(scrape(frontend), "worker_kv_total_blocks", "kvkill", victim.instance_id) is not None:
        assert time.monotonic() < deadline, "the dead worker's gauges are still exported"
        time.sleep(0.2)
    (after,) = routed(servers, frontend, "kvkill", prefix + " " + text(10))
    assert after["worker_id"] == survivor.instance_id
