"""KV-aware routing end to end: mocker workers (``in=dyn://... out=mocker``) publish KV events over a real
nats-server, a frontend (``in=http out=dyn --router-mode kv``) routes by them, found through a real etcd.

Which worker a request went to, and how many of its prompt blocks the router thought were cached there,
is read from the router's decisions, topic ``kv-hit-rate`` of the event plane on NATS
(``{"worker_id", "isl_blocks", "overlap_blocks"}``), which the test subscribes to with nats-py
(harness/events.py reads the envelopes).

Two workers per model: ``kvev`` (shared by the KV-events frontend and the ``--use-kv-events false``
frontend, each test with its own prompts) and ``kvkill`` (one of them is killed -9).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import pytest

from harness.events import kv_events, nats_subject, payload, undecodable_kv_event
from harness.fleet import kv_frontend, metric, sees_instances, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import etcd_and_nats_env
from harness.wait import until, wait_until

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 16
NUM_BLOCKS = 512
MOCKER_ARGS = {"num_gpu_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "speedup_ratio": 20.0}


# -- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env() as env:
        yield env


@pytest.fixture(scope="module")
def workers(servers, tiny_model: Path, tmp_path_factory) -> Iterator[dict[str, list[DynamoWorker]]]:
    args_file = write_engine_args(tmp_path_factory.mktemp("mocker") / "mocker.json", MOCKER_ARGS)
    fleet = {ns: [DynamoWorker(f"in=dyn://{ns}.mocker.generate", "out=mocker", str(tiny_model), "--model-name", ns,
                               "--extra-engine-args", str(args_file), env=servers) for _ in range(2)]
             for ns in ("kvev", "kvkill")}
    with workers_running([w for ws in fleet.values() for w in ws]):
        yield fleet


def _frontend(servers: dict[str, str], workers, *flags: str, env: dict[str, str] | None = None) -> DynamoRun:
    return kv_frontend({**servers, **(env or {})}, *flags,
                       ready=sees_instances([w for ws in workers.values() for w in ws], models=2),
                       what="the frontend to see the workers")


@pytest.fixture(scope="module")
def frontend(servers, workers) -> Iterator[DynamoRun]:
    with _frontend(servers, workers) as fe:
        yield fe


@pytest.fixture(scope="module")
def approx_frontend(servers, workers) -> Iterator[DynamoRun]:
    with _frontend(servers, workers, "--use-kv-events", "false") as fe:
        yield fe


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


async def frontend_caught_up(nc: Any, fe: DynamoRun, subject: str) -> None:
    """Return once ``fe`` has handled every message this connection has seen on ``subject`` so far.

    nats-server hands a message to every subscription as it routes it, and each subscription gets its
    messages in order; so a marker published now reaches the frontend after everything this test has
    already received. The marker is an undecodable KV event, which the frontend's KV router logs and
    skips: once its unique name is in the frontend's log, the events before it were applied."""
    marker = f"barrier-{uuid.uuid4().hex}"
    await nc.publish(subject, undecodable_kv_event(marker))
    await nc.flush()
    await until(lambda: marker in fe.stderr_text(), 10, "the frontend to handle the marker event")


async def _observed(servers: dict[str, str], fe: DynamoRun, ns: str, sends: list[Any], sync: bool) -> tuple[
        list[dict[str, Any]], list[Any]]:
    """Run ``sends`` (coroutine functions of an httpx client) at once; the router's decisions published
    meanwhile, in order, and what each send returned. With ``sync``, also wait until the frontend's router
    has the KV events of the blocks the last request stored: the worker announced at least the blocks it
    did not have yet (``isl_blocks - overlap_blocks``) and the frontend got past them."""
    nc = await nats.connect(servers["NATS_SERVER"])
    events: list[dict[str, Any]] = []
    stored: dict[int, int] = {}
    kv_subject = nats_subject(ns, "kv-events", "mocker", "generate")

    async def on_event(msg: Any) -> None:
        events.append(payload(msg.data))

    async def on_kv(msg: Any) -> None:
        for e in kv_events(msg.data):
            data = e["event"]["data"]
            if isinstance(data, dict) and "stored" in data:
                stored[e["worker_id"]] = stored.get(e["worker_id"], 0) + len(data["stored"]["blocks"])

    try:
        await nc.subscribe(nats_subject(ns, "kv-hit-rate"), cb=on_event)
        await nc.subscribe(kv_subject, cb=on_kv)
        await nc.flush()
        async with httpx.AsyncClient(timeout=30) as client:
            results = await asyncio.gather(*(send(client) for send in sends))
        await until(lambda: len(events) >= len(sends), 10, "the router's decisions")
        if sync:
            last = events[-1]
            want = last["isl_blocks"] - last["overlap_blocks"]
            await until(lambda: stored.get(last["worker_id"], 0) >= want, 10, "the worker's stored-blocks events")
            await frontend_caught_up(nc, fe, kv_subject)
    finally:
        await nc.close()
    return events, results


def routed(servers: dict[str, str], fe: DynamoRun, ns: str, *prompts: str, sync: bool = False
           ) -> list[dict[str, Any]]:
    """Send ``prompts`` at once; the router's decisions, in order (``sync``: see :func:`_observed`)."""
    sends = [lambda client, p=p: _send(client, fe, ns, p) for p in prompts]
    return asyncio.run(_observed(servers, fe, ns, sends, sync))[0]


def route_until_cached(servers: dict[str, str], fe: DynamoRun, ns: str, prompt: str) -> dict[str, Any]:
    """Send ``prompt``, wait until the frontend's router has the KV events of the blocks it stored, send it
    again: the second decision, which must find the prompt's blocks cached."""
    routed(servers, fe, ns, prompt, sync=True)
    (event,) = routed(servers, fe, ns, prompt)
    assert event["overlap_blocks"] > 0, f"the router found nothing of a prompt whose blocks were stored: {event}"
    return event


def scrape(fe: DynamoRun) -> str:
    return httpx.get(fe.base_url + "/metrics").text


def gauge(metrics: str, name: str, model: str, worker_id: int) -> float | None:
    # Dynamo 1.x's per-worker gauges have no model label; ours have it
    pattern = (rf'^dynamo_frontend_{name}\{{(?=[^}}]*model="{model}"|(?![^}}]*model=))(?=[^}}]*worker_id="{worker_id}")'
               rf'(?=[^}}]*dp_rank="0")[^}}]*\}} (\S+)$')
    m = re.search(pattern, metrics, re.M)
    return float(m.group(1)) if m else None


# -- tests -------------------------------------------------------------------------------------------

def test_shared_prefix_goes_to_the_worker_that_caches_it(servers, workers, frontend):
    prefix = text(120)
    (first,) = routed(servers, frontend, "kvev", prefix + " " + text(10), sync=True)
    assert first["overlap_blocks"] == 0
    assert first["isl_blocks"] > 20
    (second,) = routed(servers, frontend, "kvev", prefix + " " + text(10))
    assert second["worker_id"] == first["worker_id"]
    # the prefix is most of the prompt: nearly all of its blocks were found
    assert second["overlap_blocks"] >= first["isl_blocks"] - 4

    # the frontend's /metrics show both workers' load, and the hit on the first one
    ids = {w.instance_id for w in workers["kvev"]}
    assert first["worker_id"] in ids
    def gauges_in() -> str | None:
        metrics = scrape(frontend)
        totals = {i: gauge(metrics, "worker_kv_total_blocks", "kvev", i) for i in ids}
        hit = gauge(metrics, "worker_prefix_cache_hit_rate", "kvev", first["worker_id"])
        return metrics if all(v == NUM_BLOCKS for v in totals.values()) and hit else None

    metrics = wait_until(gauges_in, 5, "the per-worker gauges (total blocks, hit rate) on /metrics")
    hit = gauge(metrics, "worker_prefix_cache_hit_rate", "kvev", first["worker_id"])
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


def test_the_decision_log_records_what_the_router_saw(servers, workers, tmp_path):
    """``DYN_ROUTER_LOG``: the frontend writes each decision with what each candidate held, the KV events as
    they arrived, and each request's first token and end, while it serves (flushed within half a second)."""
    path = tmp_path / "decisions.jsonl"
    fe = _frontend(servers, workers, env={"DYN_ROUTER_LOG": str(path)})
    try:
        prefix = text(120)
        (first,) = routed(servers, fe, "kvev", prefix + " " + text(10), sync=True)
        (second,) = routed(servers, fe, "kvev", prefix + " " + text(10))

        def logged() -> list[dict[str, Any]] | None:
            try:
                lines = [json.loads(x) for x in path.read_text().splitlines()]
            except (OSError, ValueError):  # not there yet, or a line being written
                return None
            done = sum(x["ev"] == "done" for x in lines)
            return lines if done == 2 and sum(x["ev"] == "route" for x in lines) == 2 else None

        lines = wait_until(logged, 10, "two decisions and their ends in the decision log")
        assert "logging every decision to" in fe.stderr_text()
    finally:
        fe.stop()
    routes = [x for x in lines if x["ev"] == "route"]
    w = f"{first['worker_id']:x}"
    assert [r["worker"] for r in routes] == [w, w] and second["worker_id"] == first["worker_id"]
    assert routes[0]["candidates"][w]["overlap"] == 0
    assert routes[1]["candidates"][w]["overlap"] == second["overlap_blocks"] > 0
    assert len(routes[1]["candidates"]) == 2  # both workers, each with its cost terms and load
    # the first request's blocks were announced before the second decision, and it got a first token
    assert any(x["ev"] == "stored" and x["worker"] == w and x["t"] < routes[1]["t"] for x in lines)
    assert [x["id"] for x in lines if x["ev"] == "first"] == [r["id"] for r in routes]


def test_cached_tokens_reach_the_client_through_out_dyn(servers, workers, frontend):
    """The mocker reports its prefix hit; it travels in the worker's items and ends up in OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, unary and streamed, matching what the router expected."""
    before = {k: metric(frontend, f"dynamo_frontend_cached_tokens_{k}", model="kvev") for k in ("count", "sum")}
    prefix = text(120)
    routed(servers, frontend, "kvev", prefix + " " + text(10), sync=True)
    (decision,) = routed(servers, frontend, "kvev", prefix + " " + text(10))
    assert decision["overlap_blocks"] > 0
    body = {"model": "kvev", "prompt": prefix + " " + text(10), "max_tokens": 2}
    unary = httpx.post(frontend.api_url + "/completions", json=body, timeout=30).json()["usage"]
    # the mocker counts whole cached blocks; the router saw about as many (this prompt's tail differs)
    cached = unary["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK_SIZE == 0 and cached >= (decision["overlap_blocks"] - 1) * BLOCK_SIZE, (unary, decision)
    assert cached < unary["prompt_tokens"]
    async def chat_usage(client: httpx.AsyncClient) -> dict[str, Any]:
        async with client.stream("POST", frontend.api_url + "/chat/completions", json={
                "model": "kvev", "messages": [{"role": "user", "content": prefix}], "max_tokens": 2,
                "stream": True, "stream_options": {"include_usage": True}}) as resp:
            chunks = [json.loads(line[6:]) async for line in resp.aiter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"] == []
        return chunks[-1]["usage"]

    # a new chat prompt: its first block starts with the chat template's tokens, which no earlier prompt
    # had, so nothing of it is cached anywhere
    _, (usage,) = asyncio.run(_observed(servers, frontend, "kvev", [chat_usage], sync=True))
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    # the same chat again goes back to the worker that has all of its complete blocks now (the router
    # has the KV events of the first one: sync above)
    (again,), (usage,) = asyncio.run(_observed(servers, frontend, "kvev", [chat_usage], sync=False))
    assert again["overlap_blocks"] == usage["prompt_tokens"] // BLOCK_SIZE, (again, usage)
    assert usage["prompt_tokens_details"]["cached_tokens"] == again["overlap_blocks"] * BLOCK_SIZE, usage
    # and Dynamo 1.x's histogram of them counts every request of this test (5), their sum at least the two read
    after = {k: metric(frontend, f"dynamo_frontend_cached_tokens_{k}", model="kvev") for k in ("count", "sum")}
    assert after["count"] - before["count"] >= 5, (before, after)
    assert after["sum"] - before["sum"] >= cached + usage["prompt_tokens_details"]["cached_tokens"], (before, after)


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
    events = routed(servers, frontend, "kvkill", prefix + " " + text(10), sync=True)
    assert events[-1]["worker_id"] == survivor.instance_id
    # the survivor now caches the prefix: later requests follow it there
    (again,) = routed(servers, frontend, "kvkill", prefix + " " + text(10))
    assert again["worker_id"] == survivor.instance_id and again["overlap_blocks"] > 0
    # once the dead worker's lease expires its entry goes, and with it its blocks and its series
    wait_until(lambda: gauge(scrape(frontend), "worker_kv_total_blocks", "kvkill", victim.instance_id) is None, 20,
               "the dead worker's gauges to go")
    (after,) = routed(servers, frontend, "kvkill", prefix + " " + text(10))
    assert after["worker_id"] == survivor.instance_id
