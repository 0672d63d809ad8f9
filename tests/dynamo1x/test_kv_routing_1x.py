"""Mixed fleets routed by KV events across the two implementations, with real processes:

* Dynamo 1.6.1's frontend (``--router-mode kv``) in front of two workers of ours: each repeated prompt goes
  to the worker that holds it, which its router knows only from our workers' events in 1.x's form (their
  ``EventSource`` records and recovery endpoints, their ``kv-events`` streams);
* our frontend (``--router-mode kv``) in front of two 1.6.1 mockers: the same, from their events.

Each prompt is sent as token ids (so both routers hash exactly these), once, then again: the repeat must be
routed with the prompt's blocks found (``overlap_blocks`` in 1.6.1's log; ``cached_tokens`` in the usage).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.kv.hashing import compute_hashes
from harness.dynamo1x import d16_frontend, d16_mocker, models_listed
from harness.dynamo1x_kv import BLOCK, KV_PLANES, complete, decisions, fleet_envs, plain_log, prompts, routed
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until


@pytest.fixture(params=KV_PLANES)
def envs(request: pytest.FixtureRequest, store: Path) -> Iterator[tuple[dict[str, str], dict[str, str], Path | None]]:
    """(1.6.1's environment, ours, the file store or None) of one fleet."""
    with fleet_envs(request.param, store) as fleet:
        yield fleet


def test_d16_frontend_routes_repeats_to_our_worker_that_holds_them(tiny_chat_5k: Path, envs) -> None:
    theirs, ours, _ = envs
    workers = [DynamoWorker("in=dyn://kv1x.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name",
                            "tiny-chat", env=ours, startup_timeout=60).start() for _ in range(2)]
    try:
        with d16_frontend(theirs, "--router-mode", "kv", model="tiny-chat") as frontend:
            ids = {w.instance_id % (1 << 64) for w in workers}
            time.sleep(1.0)  # its router's recovery of both workers (their answers make the streams count)
            for prompt in prompts(4):
                complete(frontend.url, prompt)
                seen = len(routed(frontend))
                wait_until(lambda p=prompt, n=seen: _repeat_finds(frontend, p, n), 20,
                           "its router hears our worker's blocks")
            assert {int(w) for _, w in routed(frontend)} <= ids
            # what our workers' events carry beyond 1.x's fields (our load report) is ignored, never an error
            said = plain_log(frontend)
            assert not [x for x in said.splitlines() if re.search(r"(?i)(warn|error).*(kv_metrics|kv-events|"
                                                                   r"deserializ|decod)", x)], said[-3000:]
    finally:
        for w in workers:
            w.stop()


def _repeat_finds(frontend, prompt: list[int], seen: int) -> bool:
    """Send ``prompt`` again: True when 1.6.1's router found all its 4 blocks on the worker it picked."""
    body = complete(frontend.url, prompt)
    new = routed(frontend)[seen:]
    return bool(new) and int(new[-1][0]) == 4 and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK


def test_our_frontend_routes_repeats_to_the_d16_mocker_that_holds_them(tiny_chat_5k: Path, envs,
                                                                     tmp_path: Path) -> None:
    theirs, ours, store = envs
    log = tmp_path / "decisions.jsonl"  # our router's log: the events it applied, what it saw per request
    mockers = [d16_mocker(tiny_chat_5k, "dyn://m16kv.backend.generate", theirs, "--speedup-ratio", "0",
                          model_name="tiny-chat", store=store) for _ in range(2)]
    try:
        with DynamoRun("out=dyn", "--router-mode", "kv", env=dict(ours, DYN_ROUTER_LOG=str(log)),
                       startup_timeout=60) as frontend:
            wait_until(lambda: "tiny-chat" in models_listed(frontend.base_url), 30,
                       "our frontend lists the mockers' model")
            for prompt in prompts(4):
                complete(frontend.base_url, prompt)
                blocks = compute_hashes(prompt, BLOCK)[1]
                wait_until(lambda b=blocks: any(e["ev"] == "stored" and e["blocks"][-1:] == b[-1:]
                                              for e in decisions(log)), 20,
                           "our router applies the mocker's stored event")
                usage = complete(frontend.base_url, prompt)["usage"]  # once: no second chance for a coin toss
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK, usage
                wait_until(lambda: _last_route(log) is not None, 5,
                           "the repeat's decision in the log")
                route = _last_route(log)
                assert route["candidates"][route["worker"]]["overlap"] == 4, route
    finally:
        for m in mockers:
            m.stop()


def _last_route(path: Path) -> dict | None:
    routes = [e for e in decisions(path) if e["ev"] == "route"]
    return routes[-1] if len(routes) % 2 == 0 and routes else None


def test_our_frontend_started_later_recovers_what_a_d16_mocker_holds(tiny_chat_5k: Path, envs, tmp_path: Path) -> None:
    """Blocks stored before our router existed reach it only through the mocker's recovery endpoint (its
    ``worker_kv_query_source_*``, named in its EventSource record): the first request of ours already finds
    them."""
    theirs, ours, store = envs
    log = tmp_path / "decisions.jsonl"
    prompt = prompts(1)[0]
    with d16_mocker(tiny_chat_5k, "dyn://m16rec.backend.generate", theirs, "--speedup-ratio", "0",
                    model_name="tiny-chat", store=store), \
            d16_frontend(theirs, "--router-mode", "kv", model="tiny-chat") as first:
        complete(first.url, prompt)  # the mocker now holds the prompt's 4 blocks
        with DynamoRun("out=dyn", "--router-mode", "kv", env=dict(ours, DYN_ROUTER_LOG=str(log)),
                       startup_timeout=60) as frontend:
            wait_until(lambda: "tiny-chat" in models_listed(frontend.base_url), 30,
                       "our frontend lists the mocker's model")
            wait_until(lambda: any(e["ev"] == "route" for e in decisions(log)) or _recovered(frontend), 20,
                       "our router recovers the mocker's blocks")
            usage = complete(frontend.base_url, prompt)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK, usage
            wait_until(lambda: any(e["ev"] == "route" for e in decisions(log)), 5,
                       "the decision in the log")
            route = [e for e in decisions(log) if e["ev"] == "route"][-1]
            assert route["candidates"][route["worker"]]["overlap"] == 4, route


def _recovered(frontend) -> bool:
    return "KV state of worker" in frontend.stderr_text() and "4 cached blocks" in frontend.stderr_text()
