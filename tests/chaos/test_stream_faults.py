"""Data-plane faults against real etcd, nats-server, frontends and workers (``dynamo-run`` processes):
a worker frozen with SIGSTOP mid-stream (with and without migration) and thawed again, a worker killed -9
mid-stream, NATS killed and restarted, and ten times more requests than the workers take.

Workers run ``harness/det_engine.py``, whose next token depends only on the previous one, so every
output is checked token for token: exactly ``max_tokens`` words, each following from the one before
(a lost, repeated or reordered token breaks the chain). The liveness bound is short here
(``DYN_STREAM_LIVENESS_S=1.5``) so a frozen worker is detected in about two seconds.

The whole module runs twice: on the NATS request and event planes, and on the TCP request plane with
the ZMQ event plane (``DYN_REQUEST_PLANE=tcp``, ``DYN_EVENT_PLANE=zmq``), where NATS keeps only the model
cards' tokenizers, so killing it must not disturb a single request.

The NATS restart test runs last: it leaves the module's servers and processes on a fresh NATS.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from harness.det_engine import MID_GENERATION, next_token, word_tokens
from harness.fleet import metric
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(90)]

ENGINE = Path(__file__).resolve().parents[2] / "harness" / "det_engine.py"
LIVENESS_S = 1.5
DETECT_S = LIVENESS_S * 1.25 + 2.5  # the bound, one liveness tick, and slack for a loaded 2-core machine
TOKEN_MS = 25
LOG = "info,dynamo.worker.handlers=debug"  # a worker logs "request <id>" for each request


# -- helpers -------------------------------------------------------------------------------------------




def rid_for(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def served_by(workers: list[DynamoWorker], rid: str) -> list[DynamoWorker]:
    return [w for w in workers if f"request {rid}" in w.stderr_text()]


def body(model: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "stream": stream}


class Streamed:
    """What one streamed chat completion gave: text, error events, [DONE], when each chunk came."""

    def __init__(self) -> None:
        self.text = ""
        self.errors: list[dict] = []
        self.done = False
        self.finish: list[str] = []
        self.times: list[float] = []
        self.ended_at = 0.0


def stream_chat(base: str, model: str, max_tokens: int, rid: str,
                on_chunk: Callable[[int], None] | None = None) -> Streamed:
    """Stream one chat completion; ``on_chunk(n)`` after the n-th content chunk (to inject a fault)."""
    out = Streamed()
    n = 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body(model, max_tokens, True), timeout=30,
                      headers={"x-request-id": rid}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                out.errors.append(event["error"])
                continue
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    out.text += choice["delta"]["content"]
                    out.times.append(time.monotonic())
                    n += 1
                    if on_chunk is not None:
                        on_chunk(n)
                if choice.get("finish_reason"):
                    out.finish.append(choice["finish_reason"])
    out.ended_at = time.monotonic()
    return out


def max_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


class Chain:
    """Checks an output of the deterministic engine token for token."""

    def __init__(self, model_dir: Path) -> None:
        words = word_tokens(model_dir)
        self.ids = sorted(words)
        self.by_word = {w: i for i, w in words.items()}

    def assert_exact(self, text: str, max_tokens: int) -> None:
        words = text.split()
        assert len(words) == max_tokens, f"{len(words)} tokens instead of {max_tokens}: {text!r}"
        ids = [self.by_word[w] for w in words]
        for k, (a, b) in enumerate(zip(ids, ids[1:], strict=False)):
            assert b == next_token(a, self.ids), f"token {k + 1} does not follow token {k}: {words[k:k + 2]}"


def freeze(worker: DynamoWorker) -> None:
    worker.terminate(signal.SIGSTOP)


def thaw(worker: DynamoWorker) -> None:
    worker.terminate(signal.SIGCONT)


def health_instances(fe: DynamoRun, endpoint: str) -> set[int]:
    resp = httpx.get(fe.base_url + "/health", timeout=5)
    return {i["instance_id"] for i in resp.json().get("instances", []) if i["endpoint"] == endpoint}


def unary(fe: DynamoRun, model: str, max_tokens: int, rid: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(fe.api_url + "/chat/completions", json=body(model, max_tokens, False), timeout=timeout,
                      headers={"x-request-id": rid})


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[EtcdServer, NatsServer]]:
    with EtcdServer() as etcd, NatsServer() as nats:
        yield etcd, nats


PLANES = {"nats-planes": {"DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"},
          "tcp-zmq-planes": {"DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"}}


@pytest.fixture(scope="module", params=list(PLANES))
def planes(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def env(servers, planes) -> dict[str, str]:
    etcd, nats = servers
    return {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_STREAM_LIVENESS_S": str(LIVENESS_S),
            "DET_TOKEN_DELAY_MS": str(TOKEN_MS), "DYN_LOG": LOG, **PLANES[planes]}


@pytest.fixture(scope="module")
def chain(tiny_model: Path) -> Chain:
    return Chain(tiny_model)


def det_worker(env: dict[str, str], model_dir: Path, endpoint: str, name: str, *extra: str) -> DynamoWorker:
    return DynamoWorker(f"in=dyn://{endpoint}", f"out=pytok:{ENGINE}", str(model_dir), "--model-name", name,
                        *extra, env=env)


@pytest.fixture(scope="module")
def fleet(env, tiny_model) -> Iterator[dict[str, DynamoWorker]]:
    """det1, det2: model "det"; load1, load2: model "load", two requests at a time each."""
    workers = {
        "det1": det_worker(env, tiny_model, "chaos.det.generate", "det"),
        "det2": det_worker(env, tiny_model, "chaos.det.generate", "det"),
        "load1": det_worker(env, tiny_model, "chaos.load.generate", "load", "--max-inflight", "2"),
        "load2": det_worker(env, tiny_model, "chaos.load.generate", "load", "--max-inflight", "2"),
    }
    try:
        for w in workers.values():
            w.start(wait=False)
        for w in workers.values():
            w.wait_ready()
        yield workers
    finally:
        for w in workers.values():
            if w.running:
                thaw(w)
            w.kill()


@pytest.fixture(scope="module")
def fe_mig(env, fleet) -> Iterator[DynamoRun]:
    """A frontend allowing 3 migrations (the workers' cards allow none: the frontend's limit applies)."""
    with DynamoRun("out=dyn", "--migration-limit", "3", env=env) as fe:
        wait_until(lambda: len(health_instances(fe, "dyn://chaos.det.generate")) == 2, 15, "det workers")
        yield fe


@pytest.fixture(scope="module")
def fe_plain(env, fleet) -> Iterator[DynamoRun]:
    """No migration; a small queue (4 requests, 1 s) for the overload test."""
    with DynamoRun("out=dyn", "--queue-size", "4", "--queue-timeout", "1", env=env) as fe:
        wait_until(lambda: len(health_instances(fe, "dyn://chaos.det.generate")) == 2
                   and len(health_instances(fe, "dyn://chaos.load.generate")) == 2, 15, "workers")
        yield fe


def det_workers(fleet) -> list[DynamoWorker]:
    return [fleet["det1"], fleet["det2"]]


def wait_serving_again(fe: DynamoRun, worker: DynamoWorker, workers: list[DynamoWorker], timeout: float) -> float:
    """Send small requests until ``worker`` serves one; returns how long that took."""
    start = time.monotonic()

    def landed() -> bool:
        rid = rid_for("thaw")
        resp = unary(fe, "det", 2, rid)
        assert resp.status_code == 200, resp.text
        return bool(served_by([worker], rid))

    wait_until(landed, timeout, "the thawed worker to get requests again", interval=0.1)
    return time.monotonic() - start


# -- frozen worker ---------------------------------------------------------------------------------------


def test_frozen_worker_mid_stream_is_migrated_exactly_and_serves_again_after_sigcont(fe_mig, fleet, chain):
    workers = det_workers(fleet)
    rid = rid_for("freeze-mig")
    frozen: list[DynamoWorker] = []

    def on_chunk(n: int) -> None:
        if n == 10:
            victim = wait_until(lambda: served_by(workers, rid), 2, "the serving worker")[0]
            freeze(victim)
            frozen.append(victim)

    try:
        out = stream_chat(fe_mig.base_url, "det", 60, rid, on_chunk)
        assert frozen, "the stream ended before the worker could be frozen"
        victim = frozen[0]
        other = workers[1 - workers.index(victim)]
        assert out.done and not out.errors, out.errors
        assert out.finish == ["length"]
        chain.assert_exact(out.text, 60)
        assert served_by([other], rid), "the stream did not move to the other worker"
        assert max_gap(out.times) < DETECT_S, f"the stream stalled {max_gap(out.times):.1f}s"
        # while it is frozen, new requests go to the other worker at once (none waits on the frozen one)
        for i in range(4):
            r = rid_for(f"while-frozen{i}")
            start = time.monotonic()
            resp = unary(fe_mig, "det", 3, r)
            assert resp.status_code == 200, resp.text
            assert served_by([other], r) and time.monotonic() - start < 2.0
    finally:
        for w in frozen:
            thaw(w)
    wait_serving_again(fe_mig, frozen[0], workers, timeout=10)


# the other response transports: a connection per stream (the original's protocol) and NATS subjects
TRANSPORT_ENV = {"tcp-per-stream": {"DYN_TCP_MUX": "0"}, "nats": {"DYN_RESPONSE_TRANSPORT": "nats"}}
TRANSPORT_LOGGER = {"tcp-per-stream": "dynamo.runtime.tcp_listener", "nats": "dynamo.runtime.nats_stream"}


@pytest.mark.parametrize("transport", list(TRANSPORT_ENV))
def test_frozen_worker_mid_stream_is_migrated_on_the_other_response_transports(env, fleet, chain, transport):
    """The freeze above with the frontend's responses on a connection per stream (``DYN_TCP_MUX=0``) or on
    NATS (``DYN_RESPONSE_TRANSPORT=nats``): the frozen stream is detected by the same liveness bound
    (``DYN_STREAM_LIVENESS_S``), by that transport's own check, and migrates exactly."""
    workers = det_workers(fleet)
    rid = rid_for(f"freeze-{transport}")
    frozen: list[DynamoWorker] = []

    def on_chunk(n: int) -> None:
        if n == 10:
            victim = wait_until(lambda: served_by(workers, rid), 2, "the serving worker")[0]
            freeze(victim)
            frozen.append(victim)

    with DynamoRun("out=dyn", "--migration-limit", "3", env={**env, **TRANSPORT_ENV[transport]}) as fe:
        wait_until(lambda: len(health_instances(fe, "dyn://chaos.det.generate")) == 2, 15, "det workers")
        try:
            out = stream_chat(fe.base_url, "det", 60, rid, on_chunk)
            assert frozen, "the stream ended before the worker could be frozen"
            victim = frozen[0]
            other = workers[1 - workers.index(victim)]
            assert out.done and not out.errors, out.errors
            assert out.finish == ["length"]
            chain.assert_exact(out.text, 60)
            assert served_by([other], rid), "the stream did not move to the other worker"
            assert max_gap(out.times) < DETECT_S, f"the stream stalled {max_gap(out.times):.1f}s"
            # detected by this transport's liveness check, with the configured bound
            assert (f"{TRANSPORT_LOGGER[transport]}: response stream {rid}: no data or heartbeat from worker "
                    f"{victim.instance_hex} for {LIVENESS_S:.1f}s") in fe.stderr_text(), fe.stderr_text()[-3000:]
        finally:
            for w in frozen:
                thaw(w)
        wait_serving_again(fe, frozen[0], workers, timeout=10)


def test_frozen_worker_without_migration_ends_stream_with_error_and_done(fe_plain, fleet):
    workers = det_workers(fleet)
    rid = rid_for("freeze-plain")
    frozen: list[tuple[DynamoWorker, float]] = []

    def on_chunk(n: int) -> None:
        if n == 5:
            victim = wait_until(lambda: served_by(workers, rid), 2, "the serving worker")[0]
            freeze(victim)
            frozen.append((victim, time.monotonic()))

    try:
        out = stream_chat(fe_plain.base_url, "det", 80, rid, on_chunk)
        assert frozen
        victim, at = frozen[0]
        assert len(out.errors) == 1 and out.errors[0]["message"], out.errors
        assert out.done, "no [DONE] after the error event"
        assert out.ended_at - at < DETECT_S, f"the error came {out.ended_at - at:.1f}s after the freeze"
    finally:
        for w, _ in frozen:
            thaw(w)
    wait_serving_again(fe_plain, frozen[0][0], workers, timeout=10)


def test_frozen_worker_without_migration_unary_gets_5xx_json(fe_plain, fleet):
    workers = det_workers(fleet)
    rid = rid_for("freeze-unary")
    result: dict[str, Any] = {}

    def send() -> None:
        result["resp"] = unary(fe_plain, "det", 80, rid)
        result["at"] = time.monotonic()

    mid = {w: w.stderr_text().count(MID_GENERATION) for w in workers}
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    victim = wait_until(lambda: served_by(workers, rid), 5, "the serving worker")[0]
    # a few tokens in: the fault must hit mid-generation, not before it
    wait_until(lambda: victim.stderr_text().count(MID_GENERATION) > mid[victim], 5, "the third token")
    freeze(victim)
    frozen_at = time.monotonic()
    try:
        thread.join(DETECT_S + 5)
        assert "resp" in result, "the unary request hung"
        resp = result["resp"]
        assert 500 <= resp.status_code < 600, resp.text
        assert resp.json()["error"]["message"]
        assert result["at"] - frozen_at < DETECT_S
    finally:
        thaw(victim)
    wait_serving_again(fe_plain, victim, workers, timeout=10)


def test_request_to_an_idle_frozen_worker_goes_to_the_other_one(fe_plain, fleet, chain):
    """No stream reveals the freeze: the first request sent there is not acknowledged within the bound and
    goes to the other worker (a 200, never a 500); from then on the frozen worker is skipped."""
    workers = det_workers(fleet)
    victim, other = workers
    freeze(victim)
    try:
        took = []
        for i in range(4):  # round-robin: at least one of them is sent to the frozen worker first
            r = rid_for(f"idle-frozen{i}")
            start = time.monotonic()
            resp = unary(fe_plain, "det", 5, r)
            took.append(time.monotonic() - start)
            assert resp.status_code == 200, resp.text
            chain.assert_exact(resp.json()["choices"][0]["message"]["content"], 5)
            assert served_by([other], r)
        assert max(took) < LIVENESS_S + 2.5, took
        assert max(took) >= LIVENESS_S * 0.9, f"no request waited for the frozen worker's ack: {took}"
        start = time.monotonic()
        for i in range(4):  # set aside now: nothing waits for the frozen worker any more
            assert unary(fe_plain, "det", 2, rid_for(f"idle-frozen-after{i}")).status_code == 200
        assert time.monotonic() - start < 4 * 1.0
    finally:
        thaw(victim)
    wait_serving_again(fe_plain, victim, workers, timeout=10)


# -- kill -9 ---------------------------------------------------------------------------------------------


def test_kill9_mid_stream_with_migration_loses_and_repeats_nothing(fe_mig, fleet, env, tiny_model, chain):
    extra = det_worker(env, tiny_model, "chaos.det.generate", "det").start()
    try:
        wait_until(lambda: len(health_instances(fe_mig, "dyn://chaos.det.generate")) == 3, 15, "3 workers")
        n, max_tokens = 12, 80
        rids = [rid_for(f"kill{i}") for i in range(n)]
        results: dict[str, Streamed] = {}
        going: set[str] = set()
        all_going = threading.Event()  # every stream has its first tokens: the kill hits them mid-stream

        def run(rid: str) -> None:
            def on_chunk(k: int) -> None:
                if k == 3:
                    going.add(rid)
                    if len(going) == n:
                        all_going.set()

            results[rid] = stream_chat(fe_mig.base_url, "det", max_tokens, rid, on_chunk)

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in rids]
        for t in threads:
            t.start()
        assert all_going.wait(15), f"only {len(going)} of {n} streams started"
        on_extra = [r for r in rids if served_by([extra], r)]
        migrated_before = metric(fe_mig, "dynamo_frontend_model_migration_total", model="det",
                                 migration_type="ongoing_request")
        extra.kill()
        for t in threads:
            t.join(30)
        assert on_extra, "no stream was on the killed worker"
        # its streams shared one multiplexed call-home connection (runtime/mux.py), all lost at once
        assert "share one multiplexed connection" in extra.stderr_text()
        assert len(results) == n
        for rid, out in results.items():
            assert out.done and not out.errors, (rid, out.errors)
            chain.assert_exact(out.text, max_tokens)
        # each stream that was on the killed worker moved once, and /metrics says so
        migrated = metric(fe_mig, "dynamo_frontend_model_migration_total", model="det",
                          migration_type="ongoing_request")
        assert migrated - migrated_before == len(on_extra)
    finally:
        extra.kill()


# -- overload ------------------------------------------------------------------------------------------


def test_overload_gets_503_with_retry_after_and_the_service_carries_on(fe_plain, fleet, chain):
    # two workers taking two requests each, a queue of 4 for 1 s: 40 at once is 10x what they take
    async def burst() -> list[tuple[int, dict[str, str], str]]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            async def one() -> tuple[int, dict[str, str], str]:
                resp = await client.post(fe_plain.api_url + "/chat/completions", json=body("load", 30, False))
                return resp.status_code, dict(resp.headers), resp.text

            return await asyncio.gather(*(one() for _ in range(40)))

    rejected_before = metric(fe_plain, "dynamo_frontend_model_rejection_total", model="load",
                             endpoint="chat_completions")
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(burst()))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    # while the burst runs, the queue in front of the workers is on /metrics
    queued = 0.0
    while not done.is_set() and not queued:
        queued = metric(fe_plain, "dynamo_frontend_router_queue_pending_requests", model="load")
    assert done.wait(60)
    results = outcome[0]
    assert 0 < queued <= 4, "the queue was never seen on /metrics"
    statuses = sorted(s for s, _, _ in results)
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) + len(busy) == len(results), f"statuses other than 200/503: {statuses}"
    assert len(ok) >= 4 and len(busy) >= 20, statuses
    for _, headers, text in busy:
        assert headers.get("retry-after") == "1"
        error = json.loads(text)["error"]
        assert error["type"] == "service_unavailable" and error["message"]
    for _, _, text in ok:
        chain.assert_exact(json.loads(text)["choices"][0]["message"]["content"], 30)
    rejected = metric(fe_plain, "dynamo_frontend_model_rejection_total", model="load", endpoint="chat_completions")
    assert rejected - rejected_before == len(busy)
    assert metric(fe_plain, "dynamo_frontend_router_queue_pending_requests", model="load") == 0
    # still serving afterwards
    resp = unary(fe_plain, "load", 5, rid_for("after"))
    assert resp.status_code == 200, resp.text


# -- NATS restart (last: the module's processes end up on a fresh NATS) ------------------------------------


def test_nats_restart_streams_continue_and_service_recovers(fe_mig, fleet, servers, chain, planes):
    """On the NATS planes a request while NATS is down gets a clean 503; on TCP and ZMQ it is served."""
    _, nats = servers
    rid = rid_for("nats")
    killed: list[float] = []

    def on_chunk(n: int) -> None:
        if n == 5:
            nats.kill()
            killed.append(time.monotonic())

    try:
        # a stream in flight goes on: responses travel over TCP, not NATS
        out = stream_chat(fe_mig.base_url, "det", 60, rid, on_chunk)
        assert killed
        assert out.done and not out.errors, out.errors
        chain.assert_exact(out.text, 60)
        # while NATS is down a request gets a clean 503, not a 500 and not a hang (on TCP: served)
        start = time.monotonic()
        resp = unary(fe_mig, "det", 3, rid_for("nats-down"), timeout=60)
        if planes == "tcp-zmq-planes":
            assert resp.status_code == 200, resp.text
            chain.assert_exact(resp.json()["choices"][0]["message"]["content"], 3)
            return
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["message"]
        assert time.monotonic() - start < 20
    finally:
        nats.tmpdir.mkdir(parents=True, exist_ok=True)  # kill() removed it; same port, fresh store
        nats.start()
    restarted = time.monotonic()

    def serves() -> bool:
        return unary(fe_mig, "det", 3, rid_for("nats-back"), timeout=30).status_code == 200

    wait_until(serves, 20, "requests to succeed after NATS came back", interval=0.2)
    recovered = time.monotonic() - restarted
    for i in range(6):
        resp = unary(fe_mig, "det", 10, rid_for(f"nats-after{i}"))
        assert resp.status_code == 200, resp.text
        chain.assert_exact(resp.json()["choices"][0]["message"]["content"], 10)
    print(f"recovered {recovered:.1f}s after NATS restarted")
