"""A partition on the TCP request plane (tests/netns/conftest.py): the frontend's connection to one worker
goes silent (no reset, no FIN) while etcd, NATS and the other worker still reach both. Requests go over
the worker's own listener here, not through nats-server, so the request itself vanishes on the cut link:
the frontend must notice the missing ack within its liveness bound, set the worker aside and send the
request elsewhere, without spending a migration attempt (nothing reached a worker), and take the worker
back once it answers again."""

from __future__ import annotations

import uuid

import pytest

from harness.fleet import served_by
from harness.netns_fleet import chat, instances, metric, open_fds, prompt, sees
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)

LIVENESS_S = 2.0  # the frontend's DYN_STREAM_LIVENESS_S: how long it waits for an ack
FD_SLACK = 4  # descriptors a healed frontend may hold beyond its count before the cut


def test_a_request_lost_on_a_cut_tcp_link_goes_to_the_other_worker_without_a_migration_attempt(fleet, topology):
    """Round-robin over two workers on the TCP request plane, migration limit 0 (a request that cost a
    migration attempt would fail). fe and w1 are cut: every request still succeeds, every one is served
    by w2 after the frontend set w1 aside ("is not responding"), and none reached w1. Healed: w1 is sent
    requests again, listed once, and the frontend holds nothing in flight and no leaked descriptor."""
    ns = f"x{uuid.uuid4().hex[:6]}"
    endpoint = f"{ns}.mocker.generate"
    tcp = {"DYN_REQUEST_PLANE": "tcp", "DYN_LOG": "info,dynamo.worker.handlers=debug"}
    w1 = fleet.worker("w1", endpoint, "m", env=fleet.host_env("w1", **tcp))
    w2 = fleet.worker("w2", endpoint, "m", env=fleet.host_env("w2", **tcp))
    workers = [w1, w2]
    fe = fleet.frontend("--router-mode", "round-robin", "--migration-limit", "0",
                        env=fleet.host_env("fe", DYN_REQUEST_PLANE="tcp", DYN_STREAM_LIVENESS_S=str(LIVENESS_S)))
    wait_until(lambda: sees(fe, endpoint, workers), 30, "the frontend to see both workers")
    warm = [f"warm{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    for rid in warm:
        assert chat(fe, "m", prompt(20), rid).status_code == 200
    assert {id(w) for rid in warm for w in served_by(workers, rid)} == {id(w1), id(w2)}, \
        "round-robin did not use both workers before the cut"
    fds_before = open_fds(fe)

    topology.cut_between("fe", "w1")
    during = [f"during{i}-{uuid.uuid4().hex[:8]}" for i in range(6)]
    for rid in during:
        resp = chat(fe, "m", prompt(20), rid)
        assert resp.status_code == 200, f"{rid}: {resp.status_code} {resp.text}"
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert "is not responding" in fe.stderr_text(), "the frontend never set the cut worker aside"
    for rid in during:  # with --migration-limit 0, one that had cost a migration attempt would have failed
        assert served_by(workers, rid) == [w2], f"{rid} was not served by the reachable worker"
    topology.heal_between("fe", "w1")

    def w1_serves_again() -> bool:
        rid = f"back-{uuid.uuid4().hex[:8]}"
        resp = chat(fe, "m", prompt(20), rid)
        assert resp.status_code == 200, resp.text
        return served_by(workers, rid) == [w1]

    wait_until(w1_serves_again, 30, "the healed worker to be sent requests again", interval=0.2)
    assert sorted(instances(fe, endpoint)) == sorted(w.instance_id for w in workers)
    wait_until(lambda: metric(fe.base_url + "/metrics", "dynamo_frontend_inflight_requests") == 0, 15,
               "no request left in flight on the frontend")
    wait_until(lambda: open_fds(fe) <= fds_before + FD_SLACK, 15,
               f"the frontend's descriptors back to {fds_before} (+{FD_SLACK})")
