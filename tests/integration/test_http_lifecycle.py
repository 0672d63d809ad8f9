"""Client disconnects and server shutdown while streams are in flight.

These need a server whose engine is slow enough to still be streaming when the test acts, so each test
starts its own with a per-token delay; nothing here asserts on how long anything took, only on what the
client and /metrics see (polling with a generous bound where the server needs a moment).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.proc import DynamoRun

LONG_PROMPT = "word " * 300  # about 300 tokens: ~15 s of streaming at 50 ms a token


def inflight(base_url: str, model: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_inflight_requests") and s.labels.get("model") == model:
                return s.value
    return 0.0


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def slow_core(tiny_model: Path):
    with DynamoRun("out=echo_core", str(tiny_model), delay_ms=50) as srv:
        yield srv


def test_client_disconnect_stops_the_request(slow_core: DynamoRun):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True,
            "nvext": {"ignore_eos": True}}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", slow_core.api_url + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            while got < 3:
                if next(lines).startswith("data:"):
                    got += 1
            assert inflight(slow_core.base_url, "tiny-chat") == 1
        # leaving the block closes the connection mid-stream
    assert wait_for(lambda: inflight(slow_core.base_url, "tiny-chat") == 0), slow_core.stderr_text()
    # the server is fine afterwards
    r = httpx.post(slow_core.api_url + "/completions", json={"model": "tiny-chat", "prompt": "ok"})
    assert r.json()["choices"][0]["text"] == "ok"


def test_sdk_stream_close_stops_the_request(slow_core: DynamoRun):
    client = openai.OpenAI(base_url=slow_core.api_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny-chat", prompt=LONG_PROMPT, stream=True)
    it = iter(stream)
    first = next(it)
    assert first.choices[0].text
    assert inflight(slow_core.base_url, "tiny-chat") == 1
    stream.close()
    assert wait_for(lambda: inflight(slow_core.base_url, "tiny-chat") == 0), slow_core.stderr_text()


async def test_async_client_cancelled_mid_stream(slow_core: DynamoRun):
    import asyncio

    client = openai.AsyncOpenAI(base_url=slow_core.api_url, api_key="unused", max_retries=0)
    started = asyncio.Event()

    async def consume():
        stream = await client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": LONG_PROMPT}], stream=True,
            extra_body={"nvext": {"ignore_eos": True}})
        async for _ in stream:
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    assert await asyncio.to_thread(inflight, slow_core.base_url, "tiny-chat") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.close()
    assert await asyncio.to_thread(wait_for, lambda: inflight(slow_core.base_url, "tiny-chat") == 0)


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[str], threading.Event, list]:
    lines: list[str] = []
    errors: list[BaseException] = []
    first = threading.Event()

    def run():
        try:
            with httpx.stream("POST", url, json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, lines, first, errors


def text_of(lines: list[str]) -> tuple[str, str | None]:
    text, finish = "", None
    for d in lines:
        if d == "[DONE]":
            continue
        choice = json.loads(d)["choices"][0]
        text += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_lets_a_short_stream_finish(tiny_model: Path, sig):
    srv = DynamoRun("out=echo_core", str(tiny_model), delay_ms=20).start()
    try:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "short"}], "stream": True,
                "nvext": {"ignore_eos": True}}
        t, lines, first, errors = stream_in_thread(srv.api_url + "/chat/completions", body)
        assert first.wait(10)
        srv.terminate(sig)
        assert srv.wait(20) == 0, srv.stderr_text()
        t.join(10)
    finally:
        srv.stop()
    assert not errors, errors
    assert lines[-1] == "[DONE]"
    text, finish = text_of(lines)
    assert text.endswith("<|im_start|>user\nshort<|im_end|>\n<|im_start|>assistant\n")  # all of it
    assert finish == "stop"


@pytest.mark.parametrize("grace_var", ["DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT_SECS", "DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT"])
def test_shutdown_ends_a_long_stream_cleanly_after_the_grace_period(tiny_model: Path, grace_var: str):
    srv = DynamoRun("out=echo_core", str(tiny_model), delay_ms=50, env={grace_var: "0.2"}).start()
    try:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True,
                "nvext": {"ignore_eos": True}}
        t, lines, first, errors = stream_in_thread(srv.api_url + "/chat/completions", body)
        assert first.wait(10)
        t0 = time.monotonic()
        srv.terminate()
        assert srv.wait(20) == 0, srv.stderr_text()
        stopped_after = time.monotonic() - t0
        t.join(10)
    finally:
        srv.stop()
    assert stopped_after < 4, "the 0.2 s grace was not applied (default: 5 s)"
    assert not errors, errors  # no cut connection
    assert lines[-1] == "[DONE]"
    text, finish = text_of(lines)
    assert finish == "stop"
    assert 0 < len(text) < len(LONG_PROMPT)  # ended early, but with a finish chunk
    assert "Traceback" not in srv.stderr_text()


def test_shutdown_when_idle_exits_zero(tiny_model: Path):
    srv = DynamoRun("out=echo_full").start()
    srv.terminate()
    assert srv.wait(20) == 0
    assert "Traceback" not in srv.stderr_text()
