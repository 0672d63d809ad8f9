"""A fleet across hosts (network namespaces, tests/netns/conftest.py): serving and KV routing with etcd
and NATS on a host of their own, the KV events crossing hosts; a frontend that keeps its planes on
loopback fails with the setting it lacks named; and partitions: a cable cut mid-stream (silence, no reset)
and a worker cut from etcd and NATS for longer than its lease."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any, Callable

import httpx
import nats
import pytest

from harness.events import kv_events, nats_subject, undecodable_kv_event
from harness.fleet import served_by, sse_events
from harness.netns_fleet import chat, instances, metric, prompt, sees
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import until, wait_until

pytestmark = pytest.mark.timeout(180)

LIVENESS_S = 2.0  # the frontends' DYN_STREAM_LIVENESS_S: a silent worker is noticed after 2 to 2.5 s
LEASE_TTL_S = 3  # the workers' DYN_LEASE_TTL


def _stored_and_applied(nats_url: str, fe: DynamoRun, ns: str, send: Callable[[], httpx.Response]) -> httpx.Response:
    """``send()``, then wait until the frontend applied the KV events the worker published for it.

    The test listens on the workers' KV-event subject from its own leg of the switch: once a stored-blocks
    event went by, it publishes a marker the frontend's router logs as undecodable; nats-server delivers
    in order, so when the marker is in the frontend's log, the worker's events (which crossed from the
    worker's host through NATS's host) were applied before it."""

    async def run() -> httpx.Response:
        nc = await nats.connect(nats_url)
        stored: list[int] = []
        subject = nats_subject(ns, "kv-events", "mocker", "generate")

        async def on_kv(msg: Any) -> None:
            for e in kv_events(msg.data):
                data = e.get("event", {}).get("data")
                if isinstance(data, dict) and "stored" in data:
                    stored.append(1)

        try:
            await nc.subscribe(subject, cb=on_kv)
            await nc.flush()
            resp = await asyncio.to_thread(send)
            await until(lambda: stored, 10, "the worker's stored-blocks event")
            marker = f"barrier-{uuid.uuid4().hex}"
            await nc.publish(subject, undecodable_kv_event(marker))
            await nc.flush()
            await until(lambda: marker in fe.stderr_text(), 10, "the frontend to handle the marker event")
        finally:
            await nc.close()
        return resp

    return asyncio.run(run())


def test_serving_and_kv_routing_across_hosts(fleet):
    """Workers on two hosts, the frontend on a third, etcd and NATS on two more: requests are served, and
    the KV router sends a prompt back to the worker that cached it (it learned so from KV events that
    crossed from the worker's host through NATS's host to the frontend's)."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    workers = [fleet.worker(h, endpoint, "m") for h in ("w1", "w2")]
    fe = fleet.frontend("--router-mode", "kv", env=fleet.host_env("fe", DYN_LOG="info,dynamo.frontend.kv_policy=debug"))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    for _ in range(2):
        text = prompt()
        first = f"first-{uuid.uuid4().hex[:8]}"
        resp = _stored_and_applied(fleet.env["NATS_SERVER"], fe, ns,
                                   lambda p=text, r=first: chat(fe, "m", p, r))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
        owner = served_by(workers, first)
        assert len(owner) == 1
        for i in range(3):
            again = f"again{i}-{uuid.uuid4().hex[:8]}"
            assert chat(fe, "m", text, again).status_code == 200
            assert served_by(workers, again) == owner, f"request {i} of the same prompt left the worker that holds it"
            decision = re.search(rf"request {again} -> worker ([0-9a-f]+) \((\d+) cached blocks\)", fe.stderr_text())
            assert decision and int(decision.group(2)) > 0, "the router did not know the prompt's blocks"
    with httpx.stream("POST", fe.api_url + "/chat/completions", timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "a stream across hosts"}],
                            "max_tokens": 10, "stream": True}) as resp:
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]" and len(events) >= 3


def test_a_frontend_that_keeps_its_planes_on_loopback_is_told_what_it_lacks(fleet):
    """``DYN_TCP_RPC_HOST=127.0.0.1`` on the frontend's host (right on one machine): it gives out loopback
    for its response streams, so a worker on another host dials itself. The frontend's start-up line says
    where it listens (loopback only); the worker's warning names the address it was given and the
    setting; the request fails rather than hanging."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    worker = fleet.worker("w1", endpoint, "m")
    fe = fleet.frontend(env={**fleet.env, "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_STREAM_LIVENESS_S": "1"})
    wait_until(lambda: sees(fe, endpoint, [worker]), 30, "the frontend to see the worker")
    assert "response streams 127.0.0.1 (loopback only" in fe.stderr_text()
    resp = chat(fe, "m", "hello", f"lo-{uuid.uuid4().hex[:8]}")
    assert resp.status_code >= 500
    warning = [line for line in worker.stderr_text().splitlines() if "cannot open response stream" in line]
    assert warning, worker.stderr_text()[-2000:]
    assert "to 127.0.0.1:" in warning[0] and "must set DYN_TCP_RPC_HOST" in warning[0]


def test_a_cable_cut_mid_stream_migrates_within_the_liveness_bound_then_the_worker_serves_again(fleet, topology):
    """The serving worker's host is taken off the switch mid-stream: no reset, no FIN, its packets vanish.
    The frontend hears nothing for its liveness bound, moves the stream to the other worker (the client
    gets every token, one [DONE]); once the cable is back the cut worker serves again, and nothing stays
    in flight anywhere (the worker's stream was stopped when its packets got through again)."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    workers = [fleet.worker(h, endpoint, "m", env=fleet.host_env(
        h, DYN_LOG="info,dynamo.worker.handlers=debug", DYN_SYSTEM_PORT="0")) for h in ("w1", "w2")]
    fe = fleet.frontend("--migration-limit", "3", env=fleet.host_env("fe", DYN_STREAM_LIVENESS_S=str(LIVENESS_S)))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    hosts = {workers[0].pid: "w1", workers[1].pid: "w2"}
    rid = f"cut-{uuid.uuid4().hex[:8]}"
    body = {"model": "m", "messages": [{"role": "user", "content": "cut me off"}], "stream": True,
            "max_tokens": 200, "ignore_eos": True, "stream_options": {"include_usage": True}}
    victim: DynamoWorker | None = None
    chunks, done, usage = 0, 0, None
    # the read timeout is the bound the client holds the frontend to: the liveness bound and some
    with httpx.stream("POST", fe.api_url + "/chat/completions", json=body, headers={"x-request-id": rid},
                      timeout=httpx.Timeout(30, read=4 * LIVENESS_S)) as resp:
        assert resp.status_code == 200
        for data in sse_events(resp):
            if data == "[DONE]":
                done += 1
                continue
            event = json.loads(data)
            assert "error" not in event, event
            usage = event.get("usage") or usage
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                chunks += 1
            if victim is None and chunks == 10:
                victim = wait_until(lambda: served_by(workers, rid), 5, f"the worker serving {rid}")[0]
                topology.cut(hosts[victim.pid])
    assert victim is not None, "the stream ended before its worker could be cut"
    assert done == 1
    assert usage is not None and usage["completion_tokens"] == 200  # those before the cut and after the move
    survivor = next(w for w in workers if w is not victim)
    assert served_by([survivor], rid) == [survivor]
    assert "instance" in fe.stderr_text() and "not responding" in fe.stderr_text()

    topology.heal(hosts[victim.pid])
    victim_metrics = f"http://{topology[hosts[victim.pid]].address}:{victim.system_port()}/metrics"
    wait_until(lambda: metric(victim_metrics, "dynamo_component_inflight_requests") == 0, 30,
               "the cut worker to stop the stream it was serving")

    def victim_serves_again() -> bool:
        probe = f"back-{uuid.uuid4().hex[:8]}"
        assert chat(fe, "m", prompt(20), probe).status_code == 200
        return served_by([victim], probe) == [victim]

    wait_until(victim_serves_again, 30, "the healed worker to be sent requests again", interval=0.2)
    assert sorted(instances(fe, endpoint)) == sorted(w.instance_id for w in workers)
    wait_until(lambda: metric(fe.base_url + "/metrics", "dynamo_frontend_inflight_requests") == 0, 10,
               "no request left in flight on the frontend")


def test_a_worker_cut_from_etcd_and_nats_longer_than_its_lease_leaves_then_comes_back_once(fleet, topology):
    """w1 loses the etcd and NATS hosts for twice its lease while the frontend still reaches it: etcd
    lets the lease expire, so the frontend drops the instance and serves from w2 meanwhile; healed, the
    worker re-registers (its lease again), is listed exactly once and serves again."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    env = {"DYN_LEASE_TTL": str(LEASE_TTL_S), "DYN_LOG": "info,dynamo.worker.handlers=debug"}
    workers = [fleet.worker(h, endpoint, "m", env=fleet.host_env(h, **env)) for h in ("w1", "w2")]
    fe = fleet.frontend(env=fleet.host_env("fe", DYN_STREAM_LIVENESS_S=str(LIVENESS_S)))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    cut = workers[0]
    topology.cut_between("w1", "etcd")
    topology.cut_between("w1", "nats")
    wait_until(lambda: cut.instance_id not in instances(fe, endpoint), 6 * LEASE_TTL_S,
               "the frontend to drop the worker whose lease expired")
    for i in range(4):  # meanwhile every request is served, by the worker that etcd still lists
        rid = f"during{i}-{uuid.uuid4().hex[:8]}"
        assert chat(fe, "m", prompt(20), rid).status_code == 200
        assert served_by(workers, rid) == [workers[1]]
    topology.heal_between("w1", "etcd")
    topology.heal_between("w1", "nats")
    wait_until(lambda: instances(fe, endpoint).count(cut.instance_id) == 1, 30,
               "the worker registered again")
    assert sorted(instances(fe, endpoint)) == sorted(w.instance_id for w in workers), "a duplicate instance"

    def serves_again() -> bool:
        probe = f"back-{uuid.uuid4().hex[:8]}"
        resp = chat(fe, "m", prompt(20), probe)
        assert resp.status_code == 200, resp.text
        return served_by([cut], probe) == [cut]

    wait_until(serves_again, 30, "the worker to serve again (its NATS subscription back too)", interval=0.2)
