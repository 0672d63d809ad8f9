"""Router replica sync between the two kinds of frontend: Dynamo 1.6.1's ``python -m dynamo.frontend --router-mode
kv --router-replica-sync`` and our ``dynamo-run in=http out=dyn --router-mode kv`` (replica sync is our default), in
front of the same two 1.6.1 mockers, share their bookings both ways (topic ``active_sequences_events``,
docs/routing.md "Several frontends").

A request held in flight through one frontend is counted on its worker by the other, which then routes a new
prompt to the idle worker; each frontend's ``/metrics`` shows the load per worker (``worker_active_decode_blocks``,
a gauge of both), 1.6.1's log which worker it chose, our decision log ours.  When the stream ends, the other frontend
frees the booking.  Neither side logs an error about the other's events (1.6.1 used to reject ours, ours 1.6.1's,
one line per event).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from harness.dynamo1x import d16_frontend, d16_mocker, models_listed
from harness.dynamo1x_kv import complete, decisions, fleet_envs, plain_log, prompts
from harness.proc import DynamoRun
from harness.wait import wait_until

ENDPOINT = "dyn://rsync16.backend.generate"
U64 = 1 << 64
_SELECTED = re.compile(r'Selected worker .*?request_id="([^"]+)" worker_id=(\d+)')
_BENIGN = ("Adding worker", "mm_routing", "Stream closed unexpectedly")
_ADDED = re.compile(r"Adding worker WorkerWithDpRank \{ worker_id: (\d+)")


def decode_blocks(url: str) -> dict[int, float]:
    """``worker_active_decode_blocks`` per worker (u64 ids) on a frontend's ``/metrics``: 1.6.1's gauge has no
    model label, ours one per model (one model here)."""
    found: dict[int, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("dynamo_frontend_worker_active_decode_blocks{"):
            worker = re.search(r'worker_id="(-?\d+)"', line)
            assert worker is not None, line
            found[int(worker.group(1)) % U64] = float(line.rsplit(" ", 1)[1])
    return found


def busy(blocks: dict[int, float]) -> set[int]:
    return {w for w, n in blocks.items() if n > 0}


@contextmanager
def held_stream(url: str, prompt: list[int]) -> Iterator[None]:
    """A streamed request of 1,500 tokens (seconds of decoding on the slowed mockers), open until the block ends
    (its first token has come), when the client leaves it."""
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        lines = reply.iter_lines()  # kept: dropping the iterator would close the stream
        for line in lines:
            if line.startswith("data: "):
                break
        yield


@pytest.fixture(params=["file+zmq", "etcd+nats"])
def fleet(request: pytest.FixtureRequest, store: Path, tiny_chat_5k: Path, tmp_path: Path):
    """(1.6.1's frontend, ours, our decision log, the two workers' ids as u64) in front of two 1.6.1 mockers."""
    log = tmp_path / "decisions.jsonl"
    with fleet_envs(request.param, store) as (theirs, ours, files):
        mockers = [d16_mocker(tiny_chat_5k, ENDPOINT, theirs, "--max-model-len", "2048", "--speedup-ratio", "0.05",
                              model_name="tiny-chat", store=files) for _ in range(2)]
        try:
            with d16_frontend(theirs, "--router-mode", "kv", "--router-replica-sync", model="tiny-chat") as d16, \
                 DynamoRun("out=dyn", "--router-mode", "kv", env=dict(ours, DYN_ROUTER_LOG=str(log)),
                           startup_timeout=60) as our:
                wait_until(lambda: "tiny-chat" in models_listed(our.base_url), 30, "our frontend lists the model")
                workers = wait_until(lambda: set(decode_blocks(our.base_url)) if len(decode_blocks(our.base_url)) == 2
                                     else None, 30, "our frontend has both workers")
                wait_until(lambda: set(map(int, _ADDED.findall(plain_log(d16)))) == workers, 30,
                           "1.6.1's router has both workers")
                yield d16, our, log, workers
        finally:
            for m in mockers:
                m.stop()


def test_bookings_cross_both_ways_between_our_frontend_and_1_6_1s(fleet) -> None:
    d16, our, log, workers = fleet
    time.sleep(1.0)  # both frontends' subscriptions to each other's publisher, handshakes done

    # ours books a request: 1.6.1 counts it on that worker and sends a new prompt to the other one
    with held_stream(our.base_url, prompts(1, first=10)[0]):
        (loaded,) = wait_until(lambda: busy(decode_blocks(our.base_url)) or None, 10, "our booking")
        wait_until(lambda: busy(decode_blocks(d16.url)) == {loaded}, 10, "1.6.1 counting our booking")
        assert decode_blocks(d16.url)[loaded] == 4  # the prompt's 4 full blocks, as 1.6.1 counts its own
        seen = len(_SELECTED.findall(plain_log(d16)))
        complete(d16.url, prompts(1, first=11)[0])
        chosen = wait_until(lambda: _SELECTED.findall(plain_log(d16))[seen:], 5, "1.6.1's choice in its log")
        assert int(chosen[0][1]) in workers - {loaded}, (chosen, loaded)
    # the stream ended: our Free reaches 1.6.1
    wait_until(lambda: not busy(decode_blocks(d16.url)), 10, "1.6.1 freeing our booking")

    # 1.6.1 books a request: ours counts it on that worker and sends a new prompt to the other one
    seen = len(_SELECTED.findall(plain_log(d16)))
    with held_stream(d16.url, prompts(1, first=20)[0]):
        ((_, theirs),) = wait_until(lambda: _SELECTED.findall(plain_log(d16))[seen:], 5, "1.6.1's choice in its log")
        loaded = int(theirs)
        wait_until(lambda: busy(decode_blocks(our.base_url)) == {loaded}, 10, "ours counting 1.6.1's booking")
        assert decode_blocks(our.base_url)[loaded] == 4
        routes = len([e for e in decisions(log) if e["ev"] == "route"])
        complete(our.base_url, prompts(1, first=21)[0])
        route = wait_until(lambda: [e for e in decisions(log) if e["ev"] == "route"][routes:], 5,
                           "our decision in its log")[0]
        assert int(route["worker"], 16) % U64 in workers - {loaded}, route
        assert route["candidates"][f"{loaded - U64 if loaded >= U64 // 2 else loaded:x}"]["requests"] == 1, route
    wait_until(lambda: not busy(decode_blocks(our.base_url)), 10, "ours freeing 1.6.1's booking")

    # neither side complained about the other's events (1.6.1's warnings here: its workers joining, no image
    # routing for this model, the held streams' clients leaving)
    theirs = [line for line in plain_log(d16).splitlines() if (" WARN " in line or " ERROR " in line)
              and not any(known in line for known in _BENIGN)]
    assert theirs == [], theirs
    ours = [line for line in our.stderr_text().splitlines() if "WARNING" in line or "ERROR" in line]
    assert ours == [], ours
