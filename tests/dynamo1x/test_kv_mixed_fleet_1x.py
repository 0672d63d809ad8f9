"""One model served by a worker of each kind, behind a KV router of each side, with real processes.

Dynamo 1.6.1's mocker and our ``dynamo-run out=mocker`` (both block size 64) serve the model ``tiny-chat`` on
ONE endpoint.  Behind 1.6.1's ``python -m dynamo.frontend --router-mode kv`` and behind our ``dynamo-run
in=http out=dyn --router-mode kv``, new prompts are sent until each kind of worker has served some (which one
served: 1.6.1's log or our decision log); then each prompt again: the repeat must go to the worker that
holds it, with all 4 of its blocks found.  A router knows what our worker holds from its events (1.x's form
for 1.6.1's router, ours for ours), and what 1.6.1's mocker holds from 1.x's events: both kinds, one router.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from dynamo.kv.hashing import compute_hashes
from harness.dynamo1x import d16_frontend, d16_mocker, models_listed
from harness.dynamo1x_kv import BLOCK, KV_PLANES, complete, decisions, fleet_envs, prompts, routed
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

ENDPOINT = "dyn://mixkv.backend.generate"


@pytest.fixture(params=KV_PLANES)
def fleet(request: pytest.FixtureRequest, store: Path, tiny_chat_5k: Path) -> Iterator[tuple[dict, dict, DynamoWorker]]:
    """(1.6.1's environment, ours, our worker), with 1.6.1's mocker and our worker serving ``tiny-chat`` on
    ENDPOINT."""
    with fleet_envs(request.param, store) as (theirs, ours, files):
        # the context length is in 1.x's card checksum: 1.6.1's mocker says 0 unless told, ours the model's 2048
        with d16_mocker(tiny_chat_5k, ENDPOINT, theirs, "--max-model-len", "2048", model_name="tiny-chat",
                        store=files):
            worker = DynamoWorker(ENDPOINT.replace("dyn://", "in=dyn://"), "out=mocker", str(tiny_chat_5k),
                                  "--model-name", "tiny-chat", env=ours, startup_timeout=60).start()
            try:
                yield theirs, ours, worker
            finally:
                worker.stop()


def _served_by_each_kind(send, url: str, ours: str, rounds: int = 6) -> list[str]:
    """Send new prompts (``send(prompt) -> the worker that served it``) until each kind of worker has served
    some; the workers, in prompt order.

    With no prompt cached anywhere and no load, a router may pick the same worker every time (1.6.1's breaks
    ties by the worker's id): so every second prompt is sent while a long stream keeps one worker busy, and
    goes to the other."""
    served: list[str] = []
    todo = iter(prompts(2 * rounds))
    for _ in range(rounds):
        served.append(send(next(todo)))
        with _busy(url):
            served.append(send(next(todo)))
        if ours in served and set(served) - {ours}:
            return served
    raise AssertionError(f"{2 * rounds} new prompts all went to one worker: {served}")


@contextmanager
def _busy(url: str) -> Iterator[None]:
    """A streamed request of 1,500 tokens, open until the block ends (its first token has come).  Its prompt
    has full blocks: a router counts a request's load in blocks, and 1.6.1's counts no partial one."""
    body = {"model": "tiny-chat", "prompt": prompts(1, first=100)[0], "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break
        yield


def test_d16_frontend_routes_repeats_in_a_mixed_fleet(fleet) -> None:
    theirs, _, worker = fleet
    with d16_frontend(theirs, "--router-mode", "kv", model="tiny-chat") as frontend:
        time.sleep(1.0)  # its router's recovery of both workers (their answers make the streams count)

        def send(prompt: list[int]) -> tuple[str, str, dict]:
            seen = len(routed(frontend))
            body = complete(frontend.url, prompt)
            wait_until(lambda: len(routed(frontend)) > seen, 5,
                       "the route in 1.6.1's log")
            overlap, worker_id = routed(frontend)[-1]
            return overlap, worker_id, body["usage"]

        def send_new(prompt: list[int]) -> str:
            overlap, worker_id, _ = send(prompt)
            assert overlap == "0", f"a new prompt found {overlap} blocks on {worker_id}"
            return worker_id

        served = _served_by_each_kind(send_new, frontend.url, str(worker.instance_id % (1 << 64)))
        time.sleep(2.0)  # the stored events of the last prompts, on their way to its router
        for prompt, holder in zip(prompts(len(served)), served, strict=True):
            overlap, worker_id, usage = send(prompt)
            assert (worker_id, overlap) == (holder, "4"), f"served first by {holder}: {served}"
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK, usage


def test_our_frontend_routes_repeats_in_a_mixed_fleet(fleet, tmp_path: Path) -> None:
    _, ours_env, worker = fleet
    log = tmp_path / "decisions.jsonl"
    with DynamoRun("out=dyn", "--router-mode", "kv", env=dict(ours_env, DYN_ROUTER_LOG=str(log)),
                   startup_timeout=60) as frontend:
        wait_until(lambda: "tiny-chat" in models_listed(frontend.base_url), 30,
                   "our frontend lists the model")

        def send(prompt: list[int]) -> tuple[dict, dict]:
            seen = len(_routes(log))
            usage = complete(frontend.base_url, prompt)["usage"]
            wait_until(lambda: len(_routes(log)) > seen, 5,
                       "the decision in the log")
            return _routes(log)[-1], usage

        def send_new(prompt: list[int]) -> str:
            route, _ = send(prompt)
            assert len(route["candidates"]) == 2, f"our router sees {sorted(route['candidates'])}"
            assert route["candidates"][route["worker"]]["overlap"] == 0, route
            return route["worker"]

        wait_until(lambda: len(send(prompts(1, first=99)[0])[0]["candidates"]) == 2, 20,
                   "our router has both workers")
        served = _served_by_each_kind(send_new, frontend.base_url, worker.instance_hex)
        for prompt in prompts(len(served)):
            last = compute_hashes(prompt, BLOCK)[1][-1]
            wait_until(lambda last=last: any(e["ev"] == "stored" and e["blocks"][-1:] == [last]
                                           for e in decisions(log)), 20,
                       "our router applies the prompt's stored event")
        for prompt, holder in zip(prompts(len(served)), served, strict=True):
            route, usage = send(prompt)
            assert route["worker"] == holder, f"served first by {holder}: {served}; {route}"
            assert route["candidates"][holder]["overlap"] == 4, route
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK, usage


def _routes(log: Path) -> list[dict]:
    return [e for e in decisions(log) if e["ev"] == "route"]
