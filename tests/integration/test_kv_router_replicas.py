"""Two KV-routing frontends in front of the same workers, with nothing else running (file discovery, TCP
request plane, ZMQ event plane: the zero-infrastructure default), keep their routing state in step:

* a request routed by one frontend is booked by the other on the same worker (its ``/metrics`` shows the
  load although it routed nothing), and a request for the same prefix sent to the other frontend is
  decided knowing that the prefix is in flight there (its decision log's ``inflight`` blocks);
* when the first frontend is killed -9 its bookings on the other expire after the peer TTL.

Real processes throughout: mocker workers, two ``dynamo-run in=http out=dyn --router-mode kv`` frontends,
an httpx client.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import kv_frontend, sees_model, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until
from tests.integration.test_kv_routing import gauge, scrape, text

pytestmark = pytest.mark.timeout(150)

MODEL = "rsync"
BLOCK_SIZE = 16
# slow enough that a request stays in flight for tens of seconds (a decode step is ~0.4 s)
MOCKER_ARGS = {"num_gpu_blocks": 1024, "block_size": BLOCK_SIZE, "speedup_ratio": 0.05}
PEER_TTL = 3.0


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    store = tmp_path_factory.mktemp("store")
    store.chmod(0o700)
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_ROUTER_PEER_TTL": str(PEER_TTL)}


@pytest.fixture(scope="module")
def workers(env, tiny_model: Path, tmp_path_factory) -> Iterator[list[DynamoWorker]]:
    args_file = write_engine_args(tmp_path_factory.mktemp("mocker") / "mocker.json", MOCKER_ARGS)
    with workers_running([DynamoWorker(f"in=dyn://{MODEL}.mocker.generate", "out=mocker", str(tiny_model),
                                       "--model-name", MODEL, "--extra-engine-args", str(args_file), env=env)
                          for _ in range(2)]) as ws:
        yield ws


def frontend(env: dict[str, str], decisions: Path) -> DynamoRun:
    return kv_frontend({**env, "DYN_ROUTER_LOG": str(decisions)}, ready=sees_model(MODEL, 2),
                       what="the frontend to see both workers")


def booked(fe: DynamoRun, worker: DynamoWorker) -> float:
    """The KV blocks ``fe``'s router counts in flight on ``worker`` (its own bookings and its peers')."""
    return gauge(scrape(fe), "worker_active_decode_blocks", MODEL, worker.instance_id) or 0.0


class Stream:
    """A streaming completion held open in a thread until :meth:`close` (the client then goes away)."""

    def __init__(self, fe: DynamoRun, prompt: str):
        self.stop = threading.Event()
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fe, prompt), daemon=True)
        self.thread.start()

    def _run(self, fe: DynamoRun, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 500, "stream": True}
        try:
            with httpx.stream("POST", fe.api_url + "/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200, resp.read()
                for _ in resp.iter_lines():
                    self.first.set()
                    if self.stop.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - reported by close()
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def routes(decisions: Path) -> list[dict[str, Any]]:
    if not decisions.exists():
        return []
    out = []
    for line in decisions.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:  # a line being written
            continue
        if ev.get("ev") == "route":
            out.append(ev)
    return out


def test_a_prefix_routed_by_one_frontend_is_known_to_the_other(env, workers, tmp_path):
    a = frontend(env, tmp_path / "a.jsonl")
    b = frontend(env, tmp_path / "b.jsonl")
    streams: list[Stream] = []
    try:
        prefix = text(120)
        streams.append(Stream(a, prefix + " first question"))
        # A books the request on the worker it chose; B, which routed nothing, books it too once A's
        # active-sequence event has crossed the event plane
        chosen = wait_until(lambda: next((w for w in workers if booked(a, w) > 0), None), 30,
                            "frontend A to book its request")
        blocks = wait_until(lambda: booked(b, chosen), 10, "frontend B to learn A's booking")
        assert blocks == booked(a, chosen)
        other = next(w for w in workers if w is not chosen)
        assert booked(b, other) == 0

        # the same prefix sent to B: B decides knowing that the prefix is in flight on A's worker
        streams.append(Stream(b, prefix + " second question"))
        (route,) = wait_until(lambda: routes(tmp_path / "b.jsonl"), 10, "B's decision in its log")
        seen = route["candidates"][f"{chosen.instance_id:x}"]
        prefix_blocks = len(httpx.post(a.base_url + "/tokenize", json={"model": MODEL, "prompt": prefix})
                            .json()["tokens"]) // BLOCK_SIZE
        assert seen["inflight"] >= prefix_blocks - 1, route
        assert seen["requests"] == 1, route
        assert route["candidates"].get(f"{other.instance_id:x}", {}).get("inflight", 0) == 0, route
    finally:
        for s in streams:
            s.close()
        a.stop()
        b.stop()
    for s in streams:
        assert s.error is None, s.error


def test_a_killed_frontends_bookings_expire_on_the_other(env, workers, tmp_path):
    a = frontend(env, tmp_path / "a.jsonl")
    b = frontend(env, tmp_path / "b.jsonl")
    stream = Stream(a, text(120) + " a question")
    try:
        chosen = wait_until(lambda: next((w for w in workers if booked(a, w) > 0), None), 30,
                            "frontend A to book its request")
        wait_until(lambda: booked(b, chosen), 10, "frontend B to learn A's booking")
        a.kill()
        # no Free will come from A: its heartbeats stop, and B drops what A had booked
        wait_until(lambda: booked(b, chosen) == 0, 4 * PEER_TTL, "B to free the dead frontend's booking")
        wait_until(lambda: "silent for" in b.stderr_text(), 5, "B's log line about the silent peer")
    finally:
        stream.close()
        a.stop()
        b.stop()
