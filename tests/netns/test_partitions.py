"""Partitions of a fleet across hosts (tests/netns/conftest.py): a frontend cut from one worker host while
etcd, NATS and the other worker still see it, and a worker cut from NATS alone. After every heal the
frontend holds no more file descriptors than before the cut (a small slack for the kernel's and the
loop's own) and nothing is in flight on it."""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import nats
import pytest

from dynamo.runtime.names import EndpointId
from harness.fleet import served_by
from harness.netns_fleet import NATS_STALE_S, StreamResult, chat, instances, metric, open_fds, prompt, sees, stream_chat
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)

LIVENESS_S = 2.0  # the frontend's DYN_STREAM_LIVENESS_S
FD_SLACK = 4  # descriptors a healed frontend may hold beyond its count before the cut


def _debug_workers(fleet, endpoint: str, **env: str) -> list[DynamoWorker]:
    return [fleet.worker(h, endpoint, "m", env=fleet.host_env(h, DYN_LOG="info,dynamo.worker.handlers=debug", **env))
            for h in ("w1", "w2")]


def _settled(fe: DynamoRun, fds_before: int) -> None:
    """Nothing in flight on the frontend, and its descriptors back to their level before the cut."""
    wait_until(lambda: metric(fe.base_url + "/metrics", "dynamo_frontend_inflight_requests") == 0, 15,
               "no request left in flight on the frontend")
    wait_until(lambda: open_fds(fe) <= fds_before + FD_SLACK, 15,
               f"the frontend's descriptors back to {fds_before} (+{FD_SLACK})")


def _warm(fe: DynamoRun, workers: list[DynamoWorker]) -> None:
    """Requests, two at a time (a KV router sends the second to the idle worker), until every worker
    served one: each has its connections to the frontend open."""
    def all_served() -> bool:
        rids = [f"warm-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            for resp in pool.map(lambda rid: chat(fe, "m", prompt(10), rid, max_tokens=24), rids):
                assert resp.status_code == 200, resp.text
        for rid in rids:
            served.update(id(w) for w in served_by(workers, rid))
        return len(served) == len(workers)

    served: set[int] = set()
    wait_until(all_served, 30, "every worker to serve a request", interval=0)


def _pair_landing_on(fe: DynamoRun, workers: list[DynamoWorker], target: DynamoWorker) -> str | None:
    """Two new prompts at once (a KV router sends the second to the idle worker): the one ``target``
    served, if it served one."""
    asked = {f"pair-{uuid.uuid4().hex[:8]}": prompt() for _ in range(2)}
    with ThreadPoolExecutor(2) as pool:
        for resp in pool.map(lambda rid: chat(fe, "m", asked[rid], rid, max_tokens=24), asked):
            assert resp.status_code == 200, resp.text
    return next((text for rid, text in asked.items() if served_by(workers, rid) == [target]), None)


def test_a_frontend_cut_from_one_worker_host_serves_from_the_other_then_from_both(fleet, topology):
    """fe and w1 stop reaching each other (both still reach etcd, NATS and w2) while two streams run, one
    on each worker: the one on the cut worker moves to the other after the liveness bound, whole; the
    other never notices. Requests sent during the cut all go to w2 and succeed; once healed w1 is sent
    requests again, and the frontend is back to its descriptors and has nothing in flight."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    workers = _debug_workers(fleet, endpoint)
    host_of = {workers[0].pid: "w1", workers[1].pid: "w2"}
    fe = fleet.frontend("--migration-limit", "3", env=fleet.host_env("fe", DYN_STREAM_LIVENESS_S=str(LIVENESS_S)))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    _warm(fe, workers)
    fds_before = open_fds(fe)

    cut = threading.Event()
    victim: list[DynamoWorker] = []
    rids = [f"stream{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    results: list[StreamResult] = []

    def cut_at_ten(rid: str, n: int) -> None:
        if n == 10 and rid == rids[0]:
            victim.append(wait_until(lambda: served_by(workers, rid), 5, f"the worker serving {rid}")[0])
            topology.cut_between("fe", host_of[victim[0].pid])
            cut.set()

    def run(rid: str) -> None:
        results.append(stream_chat(fe, "m", prompt(20), rid, 200, 4 * LIVENESS_S,
                                   on_chunk=lambda n: cut_at_ten(rid, n)))

    threads = [threading.Thread(target=run, args=(rid,), daemon=True) for rid in rids]
    for t in threads:
        t.start()
    assert cut.wait(30), "the first stream never reached 10 tokens"
    survivor = next(w for w in workers if w is not victim[0])
    # sent before the frontend can know: it may go to the cut worker, and then moves on with the stream
    early = f"early-{uuid.uuid4().hex[:8]}"
    assert chat(fe, "m", prompt(20), early).status_code == 200
    wait_until(lambda: "is not responding" in fe.stderr_text(), 10, "the frontend to set the cut worker aside")
    during = [f"during{i}-{uuid.uuid4().hex[:8]}" for i in range(6)]
    for rid in during:
        resp = chat(fe, "m", prompt(20), rid)
        assert resp.status_code == 200, resp.text
    for t in threads:
        t.join(60)
    assert len(results) == 2
    for r in results:
        assert r.whole and r.tokens == 200, r
    assert served_by([survivor], rids[0]) == [survivor], "the cut worker's stream did not move"
    assert "not responding" in fe.stderr_text()
    for rid in during:
        assert served_by(workers, rid) == [survivor], f"{rid} was sent to the worker the frontend cannot reach"

    topology.heal_between("fe", host_of[victim[0].pid])

    def victim_serves_again() -> bool:
        probe = f"back-{uuid.uuid4().hex[:8]}"
        resp = chat(fe, "m", prompt(20), probe)
        assert resp.status_code == 200, resp.text
        return served_by(victim, probe) == victim

    wait_until(victim_serves_again, 30, "the healed worker to be sent requests again", interval=0.2)
    assert sorted(instances(fe, endpoint)) == sorted(w.instance_id for w in workers)
    _settled(fe, fds_before)


def _no_responders(nats_url: str, subject: str) -> bool:
    """Whether nats-server has no subscriber on ``subject`` any more (asked from the test's leg)."""
    async def ask() -> bool:
        nc = await nats.connect(nats_url)
        try:
            await nc.request(subject, b"", timeout=1)  # an empty request: a worker acks it as a ping
            return False
        except nats.errors.NoRespondersError:
            return True
        except nats.errors.TimeoutError:  # subscribed, but its worker does not answer (the cut)
            return False
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_a_worker_cut_from_nats_alone_is_forgotten_by_it_then_reconnects_and_its_planes_recover(fleet, topology):
    """w1 loses the NATS host only (etcd and the frontend still reach it) for longer than nats-server
    waits for a client's pong: the server drops it, its request subject has no responder, and every
    request meanwhile goes to w2 (KV-routed). Healed, w1's NATS client reconnects and subscribes again:
    it serves again, and its KV events reach the frontend again (a repeat of its prompt is routed back to
    it for its cached blocks). Nothing stays in flight and the frontend's descriptors come back."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    workers = _debug_workers(fleet, endpoint)
    fe = fleet.frontend("--router-mode", "kv", env=fleet.host_env(
        "fe", DYN_STREAM_LIVENESS_S=str(LIVENESS_S), DYN_LOG="info,dynamo.frontend.kv_policy=debug"))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    _warm(fe, workers)
    fds_before = open_fds(fe)
    cut, other = workers
    subject = EndpointId(ns, "mocker", "generate").subject(cut.instance_id)

    topology.cut_between("w1", "nats")
    wait_until(lambda: _no_responders(fleet.env["NATS_SERVER"], subject), 4 * NATS_STALE_S,
               "nats-server to drop the cut worker")
    during = [f"during{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    for rid in during:
        resp = chat(fe, "m", prompt(), rid)
        assert resp.status_code == 200, resp.text
        assert served_by(workers, rid) == [other]
    topology.heal_between("w1", "nats")
    wait_until(lambda: "reconnected after" in cut.stderr_text(), 30, "the cut worker's NATS client to reconnect")

    text = wait_until(lambda: _pair_landing_on(fe, workers, cut), 30, "the healed worker to be sent requests again",
                      interval=0.2)

    def routed_back_for_its_blocks() -> bool:
        rid = f"again-{uuid.uuid4().hex[:8]}"
        assert chat(fe, "m", text, rid).status_code == 200
        decision = re.search(rf"request {rid} -> worker {cut.instance_id & 0xFFFFFFFFFFFFFFFF:x} \((\d+) cached blocks\)", fe.stderr_text())
        return bool(decision and int(decision.group(1)) > 0)

    wait_until(routed_back_for_its_blocks, 30, "the healed worker's KV events to reach the frontend", interval=0.2)
    assert sorted(instances(fe, endpoint)) == sorted(w.instance_id for w in workers), "a duplicate instance"
    _settled(fe, fds_before)
