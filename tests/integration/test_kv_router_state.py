"""What a KV router knows when it did not see the events happen, with real etcd, NATS and processes:

* a frontend started after the workers cached a prefix asks them (their recovery endpoints) and routes the first
  request for that prefix to the worker holding it;
* a frontend killed -9 with requests in flight leaves bookings on its peers only until its heartbeats
  are missed (``DYN_ROUTER_PEER_TTL``);
* workers that publish no KV events (``out=echo_core``) get the approximate indexer by themselves.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import pytest

from harness.events import nats_subject, payload
from harness.fleet import kv_frontend, sees_model, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer, etcd_and_nats_env
from tests.integration.test_kv_routing import route_until_cached, routed, text

pytestmark = pytest.mark.timeout(120)

MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 1.0}
PEER_TTL = 3.0


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env(DYN_ROUTER_PEER_TTL=str(PEER_TTL)) as env:
        yield env


@pytest.fixture(scope="module")
def mockers(servers, tiny_model: Path, tmp_path_factory) -> Iterator[list[DynamoWorker]]:
    args_file = write_engine_args(tmp_path_factory.mktemp("mocker") / "mocker.json", MOCKER_ARGS)
    with workers_running([DynamoWorker("in=dyn://kvst.mocker.generate", "out=mocker", str(tiny_model),
                                       "--model-name", "kvst", "--extra-engine-args", str(args_file), env=servers)
                          for _ in range(2)]) as ws:
        yield ws


def frontend(servers: dict[str, str], model: str, n_workers: int, *flags: str) -> DynamoRun:
    return kv_frontend(servers, *flags, ready=sees_model(model, n_workers), what="the frontend to see the workers")


def wait_log(proc: Any, pattern: str, count: int = 1, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(pattern, proc.stderr_text())
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{pattern!r} not logged {count} time(s):\n{proc.stderr_text()[-3000:]}")
        time.sleep(0.05)


def test_a_restarted_frontend_asks_the_workers_what_they_cache(servers, mockers):
    prefix = text(150)
    first = frontend(servers, "kvst", 2)
    try:
        cached = route_until_cached(servers, first, "kvst", prefix + " " + text(10))
    finally:
        first.stop()
    # a new frontend: no event about that prefix will come again, the workers are idle
    second = frontend(servers, "kvst", 2)
    try:
        counts = wait_log(second, r"KV state of worker [0-9a-f]+: (\d+) cached blocks", count=2)
        assert max(int(c) for c in counts) >= cached["overlap_blocks"]
        (event,) = routed(servers, second, "kvst", prefix + " " + text(10))
        assert event["worker_id"] == cached["worker_id"]
        assert event["overlap_blocks"] >= cached["overlap_blocks"] - 4  # all but the other suffix
    finally:
        second.stop()


async def _count_adds(url: str, subject: str, n: int, started: threading.Event, done: threading.Event) -> None:
    nc = await nats.connect(url)
    seen = 0
    got = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal seen
        event = payload(msg.data)  # on NATS each active-sequence event travels bare (1.x's framing there)
        if isinstance(event["data"], dict) and "AddRequest" in event["data"]:
            seen += 1
        if seen >= n:
            got.set()

    await nc.subscribe(subject, cb=cb)
    await nc.flush()
    started.set()
    try:
        await asyncio.wait_for(got.wait(), 20)
        done.set()
    finally:
        await nc.close()


def test_a_killed_frontends_bookings_expire_on_its_peer(servers, mockers):
    loaded, idle = mockers
    a = frontend(servers, "kvst", 2)
    b = frontend(servers, "kvst", 2)
    try:
        # A books 4 long requests on one worker; B hears about them (replica sync)
        started, done = threading.Event(), threading.Event()
        watcher = threading.Thread(target=asyncio.run, args=(_count_adds(
            servers["NATS_SERVER"], nats_subject("kvst", "active_sequences_events", "mocker"), 4, started,
            done),), daemon=True)
        watcher.start()
        assert started.wait(10)

        statuses: list[int] = []

        def long_request() -> None:  # about 20 s of decoding: still running when A dies
            try:
                with httpx.Client(timeout=30) as c:
                    statuses.append(c.post(a.api_url + "/completions", json={
                        "model": "kvst", "prompt": text(60), "max_tokens": 1000,
                        "nvext": {"backend_instance_id": loaded.instance_id}}).status_code)
            except httpx.HTTPError:
                pass  # A is killed under it

        for _ in range(4):
            threading.Thread(target=long_request, daemon=True).start()
        assert done.wait(20), f"B never heard of A's bookings; statuses {statuses}"
        a.kill()
        # at once, B still counts A's requests on the loaded worker and avoids it
        events = routed(servers, b, "kvst", text(60))
        events += routed(servers, b, "kvst", text(60))
        assert [e["worker_id"] for e in events] == [idle.instance_id] * 2
        # once A's heartbeats are missed, its bookings go, and B uses both workers again
        wait_log(b, r"peer router\(s\) \S+ silent for \d+ s: freed their 4 booking", timeout=PEER_TTL * 4)
        used = {e["worker_id"] for e in routed(servers, b, "kvst", *(text(60) for _ in range(8)))}
        assert used == {loaded.instance_id, idle.instance_id}
    finally:
        a.kill()
        b.stop()


def test_workers_without_kv_events_get_the_approximate_indexer(servers, tiny_model: Path):
    with workers_running([DynamoWorker("in=dyn://kvecho.echo.generate", "out=echo_core", str(tiny_model),
                                       "--model-name", "kvecho", env=servers) for _ in range(2)]):
        fe = frontend(servers, "kvecho", 2)
        try:
            wait_log(fe, r"KV router for kvecho: .*approximate indexer \(its workers do not publish KV events\)")
            prefix = text(120)
            (first,) = routed(servers, fe, "kvecho", prefix + " " + text(10))
            (second,) = routed(servers, fe, "kvecho", prefix + " " + text(10))
            # no events will ever come: the router assumed what it routed is cached, at once
            assert second["worker_id"] == first["worker_id"]
            assert second["overlap_blocks"] >= first["isl_blocks"] - 4 > 0
        finally:
            fe.stop()


def test_after_a_nats_restart_the_frontend_asks_again(tiny_model: Path, tmp_path):
    args_file = write_engine_args(tmp_path / "mocker.json", MOCKER_ARGS)
    with EtcdServer() as etcd:
        nats_srv = NatsServer().start()
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
        worker = DynamoWorker("in=dyn://kvre.mocker.generate", "out=mocker", str(tiny_model), "--model-name", "kvre",
                              "--extra-engine-args", str(args_file), env=env).start()
        fe = None
        try:
            fe = frontend(env, "kvre", 1)
            wait_log(fe, r"KV state of worker [0-9a-f]+: \d+ cached blocks")
            cached = route_until_cached(env, fe, "kvre", text(100))
            nats_srv.kill()  # events published now would be lost
            nats_srv.tmpdir.mkdir(parents=True, exist_ok=True)
            nats_srv.start()  # same port
            wait_log(fe, r"event plane reconnected: asking 1 worker\(s\) for their KV state again", timeout=20)
            (before, after) = wait_log(fe, r"KV state of worker [0-9a-f]+: (\d+) cached blocks", count=2, timeout=20)
            assert int(after) >= cached["overlap_blocks"]
        finally:
            if fe is not None:
                fe.stop()
            worker.kill()
            nats_srv.stop()
