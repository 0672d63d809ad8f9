"""1.6.1's frontend in front of our workers, when things go wrong and for the engines it does not have: a Python
engine of ours (``out=pystr:``: OpenAI chunks, no tokenizer on the 1.x side), our items with a field 1.x does not
know (``out=pytok:``), our worker killed -9 mid-stream
with 1.6.1's ``--migration-limit`` (the stream finishes on the other worker), and a client that goes away
(our worker stops generating)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from harness.dynamo1x import d16_env, d16_frontend
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoWorker, free_port
from harness.wait import wait_until

PYSTR = Path(__file__).resolve().parents[1] / "e2e" / "data" / "seed_pystr_engine.py"


def ours_env(store: Path, **extra: str) -> tuple[dict[str, str], dict[str, str]]:
    theirs = d16_env(store)
    return theirs, {**theirs, "PYTHONPATH": SRC, "DYN_LOG": "info,dynamo.worker=debug", **extra}


def stream_text(url: str, body: dict) -> tuple[str, str | None]:
    text, finish = "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish


def test_d16_frontend_serves_our_python_engine(tiny_chat_5k: Path, store: Path) -> None:
    """A ``pystr:`` engine (one Python file that yields OpenAI chunks) is a Chat worker: 1.6.1 forwards the
    request as it came and streams the worker's chunks, unary and streamed."""
    theirs, ours = ours_env(store)
    with DynamoWorker("in=dyn://py.backend.generate", f"out=pystr:{PYSTR}", str(tiny_chat_5k), "--model-name", "py",
                      env=ours), d16_frontend(theirs, model="py") as frontend:
        body = {"model": "py", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 20}
        assert stream_text(frontend.url, body) == ("The capital of France is Paris.", "stop")
        reply = httpx.post(f"{frontend.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


EXTRA_FIELD_ENGINE = """
import argparse, sys
from tokenizers import Tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
args, _ = parser.parse_known_args(sys.argv[1:])
TOKENIZER = Tokenizer.from_file(args.model_path + "/tokenizer.json")
ANSWER = TOKENIZER.encode("The capital of France is Paris.", add_special_tokens=False).ids


async def generate(request):
    for i, tid in enumerate(ANSWER):
        item = {"token_ids": [tid]}
        if i == 0:  # prompt logprobs nobody asked for: the worker passes them on (in 1.x's engine_data)
            item["prompt_logprobs"] = [None] + [{"logprob": -1.0, "top_logprobs": []} for _ in request["token_ids"][1:]]
        yield item
    yield {"token_ids": [], "finish_reason": "stop"}
"""


def test_d16_frontend_ignores_a_field_of_ours_in_our_items(tiny_chat_5k: Path, store: Path, tmp_path: Path) -> None:
    """Our worker's items are 1.x's ``LLMEngineOutput``; what 1.6.1's frontend did not ask for (here prompt
    logprobs in the last item's ``engine_data``, which our worker passes on from its engine) it skips, and
    serves the answer whole."""
    engine = tmp_path / "extra_field_engine.py"
    engine.write_text(EXTRA_FIELD_ENGINE)
    theirs, ours = ours_env(store)
    with DynamoWorker("in=dyn://xf.backend.generate", f"out=pytok:{engine}", str(tiny_chat_5k), "--model-name", "xf",
                      env=ours), d16_frontend(theirs, model="xf") as frontend:
        body = {"model": "xf", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 20}
        assert stream_text(frontend.url, body) == ("The capital of France is Paris.", "stop")


def test_d16_frontend_migrates_off_our_worker_killed_mid_stream(tiny_chat_5k: Path, store: Path) -> None:
    """Two echo_core workers of ours (50 ms a token), 1.6.1's frontend with ``--migration-limit 1``: kill -9
    the worker serving a stream after 5 tokens; 1.6.1 replays the request with the tokens so far on the other
    worker, and the client's stream goes on to its full length without an error.  (echo_core answers a
    replayed request by echoing the longer prompt from its start, so the words after the cut are not the
    ones an unbroken stream has: 1.x tells a worker nothing of which prompt tokens were generated, which our
    own frontend does; a real engine continues the text.)"""
    theirs, ours = ours_env(store, DYN_TOKEN_ECHO_DELAY_MS="50")
    workers = [DynamoWorker("in=dyn://mig.backend.generate", "out=echo_core", str(tiny_chat_5k), "--model-name", "mig",
                            env=ours, delay_ms=50) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        with d16_frontend(theirs, "--migration-limit", "1", model="mig") as frontend:
            wait_until(lambda: len(list((store / "v1" / "instances").glob("mig*generate*"))) == 2, 15,
                       "both workers' 1.x records")
            body = {"model": "mig", "messages": [{"role": "user", "content": "one two three four five six seven"}],
                    "max_tokens": 24, "ignore_eos": True}
            expected, _ = stream_text(frontend.url, body)  # the answer when nothing fails
            served = {id(w): w.stderr_text().count(" prompt tokens") for w in workers}
            text, victim, finish, pieces, used = "", None, None, 0, {}
            with httpx.stream("POST", f"{frontend.url}/v1/chat/completions", timeout=60, json={
                    **body, "stream": True, "stream_options": {"include_usage": True}}) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    used = event.get("usage") or used
                    for choice in event.get("choices") or []:
                        piece = choice["delta"].get("content") or ""
                        text += piece
                        pieces += bool(piece)
                        finish = choice.get("finish_reason") or finish
                    if victim is None and pieces >= 5:
                        before = text
                        victim = next(w for w in workers if w.stderr_text().count(" prompt tokens") > served[id(w)])
                        victim.kill()
            assert victim is not None
            assert finish == "length" and used["completion_tokens"] == 24, (finish, used, text)
            assert text.startswith(before) and expected.startswith(before)
    finally:
        for w in workers:
            if w.running:
                w.stop()


def inflight(port: int) -> float:
    """Our worker's ``dynamo_component_inflight_requests`` (all endpoints), from its system server."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_inflight_requests{"))


def test_a_client_leaving_d16_frontend_stops_our_worker(tiny_chat_5k: Path, store: Path) -> None:
    """A client that drops its stream: 1.6.1 tells our worker (kill over the call-home connection, or the
    connection closed), and the worker's engine stops: its in-flight gauge is back to 0 long before the
    200 tokens (10 s at 50 ms a token) would have been generated."""
    port = free_port()
    theirs, ours = ours_env(store, DYN_TOKEN_ECHO_DELAY_MS="50", DYN_SYSTEM_PORT=str(port))
    worker = DynamoWorker("in=dyn://gone.backend.generate", "out=echo_core", str(tiny_chat_5k), "--model-name",
                          "gone", env=ours, delay_ms=50).start()
    try:
        with d16_frontend(theirs, model="gone") as frontend:
            long = " ".join(["word"] * 300)  # echo_core echoes it: 300+ tokens, 15 s at 50 ms a token
            body = {"model": "gone", "messages": [{"role": "user", "content": long}], "max_tokens": 200,
                    "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{frontend.url}/v1/chat/completions", json=body, timeout=60) as reply:
                for n, _line in enumerate(reply.iter_lines()):
                    if n == 6:
                        assert inflight(port) == 1
                    if n > 6:
                        break
            left = time.monotonic()
            wait_until(lambda: inflight(port) == 0, 5, "the worker to stop the request")
            assert time.monotonic() - left < 5
    finally:
        worker.stop()
