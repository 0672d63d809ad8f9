"""Requests across the two implementations through their own CLIs, on the file store and on etcd: Dynamo
1.6.1's ``python -m dynamo.frontend`` in front of ``dynamo-run in=dyn://... out=mocker`` and ``out=echo_core``
(our worker answers 1.x's token items over 1.x's TCP wire), and our ``dynamo-run in=http out=dyn`` in front
of 1.6.1's mocker (our frontend detokenizes its token ids); chat, streaming and unary."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.dynamo1x import d16_env, d16_frontend, d16_mocker, models_listed
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker


def wait_listed(url: str, model: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while model not in models_listed(url):
        assert time.monotonic() < deadline, f"{model} not listed at {url} within {timeout:g}s"
        time.sleep(0.2)


def chat(url: str, model: str, max_tokens: int, stream: bool) -> tuple[str, dict, str | None]:
    """(the answer's text, its usage, its finish reason) from ``POST /v1/chat/completions``."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens,
            "stream": stream}
    if not stream:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return data["choices"][0]["message"]["content"], data["usage"], data["choices"][0]["finish_reason"]
    body["stream_options"] = {"include_usage": True}
    text, usage, finish = "", {}, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices") or []:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return text, usage, finish


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_d16_frontend_serves_our_mocker_and_echo_workers(tiny_chat_5k: Path, envs, stream: bool) -> None:
    theirs, ours, _ = envs
    with DynamoWorker("in=dyn://ours.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "our-mock",
                      env=ours, startup_timeout=60), \
            DynamoWorker("in=dyn://ours.echo.generate", "out=echo_core", str(tiny_chat_5k), "--model-name", "our-echo",
                         env=ours, startup_timeout=60), \
            d16_frontend(theirs, model="our-mock") as frontend:
        text, usage, finish = chat(frontend.url, "our-mock", 5, stream)
        assert usage["completion_tokens"] == 5 and finish == "length" and text.strip()
        # echo_core repeats the prompt's tokens: 1.6.1's frontend detokenizes them back into the prompt
        # (up to the first end-of-turn token, its stop token)
        wait_listed(frontend.url, "our-echo")
        text, usage, finish = chat(frontend.url, "our-echo", 200, stream)
        assert "You are a helpful assistant" in text and finish == "stop", (text, finish)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_our_frontend_serves_d16_mocker(tiny_chat_5k: Path, envs, stream: bool) -> None:
    theirs, ours, store = envs
    with d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", theirs, "--speedup-ratio", "0",
                    model_name="m16-model", store=store), DynamoRun("out=dyn", env=ours, startup_timeout=60) as frontend:
        wait_listed(frontend.base_url, "m16-model")
        text, usage, finish = chat(frontend.base_url, "m16-model", 6, stream)
        # the mocker's ids (1000..4999) are the padded vocabulary's filler words: our frontend decodes each
        assert text.count(" w") == 6 and usage["completion_tokens"] == 6 and finish == "length", text
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_d16_frontend_serves_our_llamacpp_worker(gguf: Path, store: Path, tmp_path: Path) -> None:
    """SmolLM2 on llama.cpp (a CPU engine 1.x does not have) behind 1.6.1's frontend: greedy answers, the same
    streamed and unary."""
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with DynamoWorker("in=dyn://ll.backend.generate", "out=llamacpp", str(gguf), "--model-name", "smol",
                      env=ours, startup_timeout=120), d16_frontend(theirs, model="smol") as frontend:
        answers = []
        for stream in (True, False):
            body = {"model": "smol", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 8, "temperature": 0, "stream": stream}
            if stream:
                text = ""
                with httpx.stream("POST", f"{frontend.url}/v1/chat/completions", json=body, timeout=120) as reply:
                    assert reply.status_code == 200, reply.read()
                    for line in reply.iter_lines():
                        if line.startswith("data: {"):
                            for choice in json.loads(line[6:]).get("choices") or []:
                                text += choice["delta"].get("content") or ""
                answers.append(text)
            else:
                reply = httpx.post(f"{frontend.url}/v1/chat/completions", json=body, timeout=120)
                assert reply.status_code == 200, reply.text
                answers.append(reply.json()["choices"][0]["message"]["content"])
        assert answers[0] and answers[0] == answers[1], answers


def test_d16_frontend_queues_on_a_full_worker_of_ours_instead_of_failing(tiny_chat_5k: Path, envs) -> None:
    """A worker of ours at its --max-inflight refuses our frontend's requests (ours queue them) but takes a
    1.x frontend's: 1.6.1's frontend retries an "overloaded" refusal elsewhere and then fails the request, so
    six concurrent requests on one worker that runs one at a time all succeed, waiting in the engine's queue."""
    theirs, ours, _ = envs
    with DynamoWorker("in=dyn://full.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "full-mock",
                      "--max-inflight", "1", env=ours, startup_timeout=60), \
            d16_frontend(theirs, model="full-mock") as frontend:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: chat(frontend.url, "full-mock", 20, False), range(6)))
        for text, usage, finish in results:
            assert usage["completion_tokens"] == 20 and finish == "length" and text.strip()
