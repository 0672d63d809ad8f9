"""``out=mistralrs`` for real: the SmolLM2 GGUF over HTTP, tiny built models in-process.

mistral.rs is slow on these machines (tens of tokens per second for SmolLM2), so answers are kept short.
Skipped when the ``mistralrs`` package is not installed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mistralrs")

from dynamo.engines.mistralrs import MistralRsEngine, _patch_rope  # noqa: E402
from dynamo.errors import ModelError, RequestError  # noqa: E402
from dynamo.llm.engine import Context  # noqa: E402
from dynamo.llm.model_source import resolve_card  # noqa: E402
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request  # noqa: E402
from harness.proc import DynamoRun, run_cli  # noqa: E402
from harness.smollm2 import smollm2_gguf_or_skip  # noqa: E402
from harness.tiny_model import build_tiny_gguf, build_tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The SmolLM2 GGUF, without llama-cpp-python (tests/conftest.py's needs it): mistral.rs reads it itself."""
    return smollm2_gguf_or_skip(need_llama_cpp=False)


# -- the real model over HTTP ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(gguf: Path):
    with DynamoRun("out=mistralrs", str(gguf), startup_timeout=120) as proc:
        yield proc


def _chat(server: DynamoRun, content: str, *, timeout: float = 180, **extra) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 16, **extra}
    return httpx.post(server.api_url + "/chat/completions", json=body, timeout=timeout)


def test_greedy_answer(server: DynamoRun) -> None:
    r = _chat(server, "What is 2+2?")
    assert r.status_code == 200, r.text
    data = r.json()
    assert "4" in data["choices"][0]["message"]["content"]
    assert data["choices"][0]["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 16


def test_stream_shape_and_usage(server: DynamoRun) -> None:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Name three colors."}],
            "temperature": 0, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", server.api_url + "/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Red" in text or "red" in text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1]["choices"] == []
    assert 0 < chunks[-1]["usage"]["completion_tokens"] <= 12 and chunks[-1]["usage"]["prompt_tokens"] > 5


def test_completions(server: DynamoRun) -> None:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The capital of Germany is", "temperature": 0,
            "max_tokens": 4}
    r = httpx.post(server.api_url + "/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion"
    assert "Berlin" in data["choices"][0]["text"]
    assert data["usage"]["completion_tokens"] <= 4


def test_stop_string(server: DynamoRun) -> None:
    r = _chat(server, "What is 2+2?", stop=["math"])
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "math" not in text and text.strip()


def test_three_concurrent_requests_all_correct(server: DynamoRun) -> None:
    prompts = {"What is 2+2?": ["4"], "Name three colors.": ["red", "blue"], "Say hello.": ["hello"]}
    results: dict[str, httpx.Response] = {}

    def ask(p: str) -> None:
        results[p] = _chat(server, p, max_tokens=12)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert set(results) == set(prompts)
    for prompt, words in prompts.items():
        r = results[prompt]
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"].lower()
        assert all(w in text for w in words), (prompt, text)


def test_error_in_one_request_does_not_break_the_next(server: DynamoRun) -> None:
    r = _chat(server, "hello " * 9000)  # longer than the model's 8192-token context
    assert r.status_code == 400, r.text
    assert "8192" in r.json()["error"]["message"]
    r = _chat(server, "What is 2+2?")
    assert r.status_code == 200 and "4" in r.json()["choices"][0]["message"]["content"]


def test_client_going_away_frees_the_engine(server: DynamoRun) -> None:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 8000, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Write a very long story."}]}
    with httpx.stream("POST", server.api_url + "/chat/completions", json=body, timeout=180) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break  # hang up after a few tokens
    # 8000 tokens take minutes at mistral.rs's best speed here (~40 tok/s); the next request must not
    # wait behind them (it takes seconds, or tens of seconds on a machine busy with other work)
    t0 = time.monotonic()
    r = _chat(server, "What is 2+2?", max_tokens=12)
    assert r.status_code == 200 and "4" in r.json()["choices"][0]["message"]["content"]
    assert time.monotonic() - t0 < 150


def test_stdin_and_batch(tmp_path: Path, gguf: Path) -> None:
    p = run_cli(["in=stdin", "out=mistralrs", str(gguf)], input="Say hello.", timeout=180)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('{"text": "What is 2+2?"}\n{"text": "Say hello."}\n')
    p = run_cli([f"in=batch:{batch}", "out=mistralrs", str(gguf)], timeout=240)
    assert p.returncode == 0, p.stderr
    out = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert len(out) == 2
    assert all(o["response"] and o["tokens_in"] > 5 and o["tokens_out"] > 0 for o in out), out


# -- tiny models, in-process -------------------------------------------------------------------------

async def _collect(engine: MistralRsEngine, raw: dict, ctx: Context | None = None) -> tuple[str, list[dict], Context]:
    ctx = ctx or Context()
    req = parse_chat_request(raw) if "messages" in raw else parse_completion_request(raw)
    chunks = [c async for c in engine.generate(req, ctx)]
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text") or ""
                   for c in chunks if c["choices"])
    return text, chunks, ctx


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("mrs"), name="tiny-chat")


async def test_hf_folder_and_gguf_of_the_same_model_agree(tiny_dir: Path, tmp_path: Path) -> None:
    gguf = build_tiny_gguf(tmp_path / "tiny-chat.gguf", tiny_dir)
    texts = []
    for source in (tiny_dir, gguf):
        engine = MistralRsEngine(resolve_card(str(source), name="tiny"))
        await engine.start()
        try:
            raw = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
                   "max_tokens": 8, "ignore_eos": True}
            text, chunks, ctx = await _collect(engine, raw)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert ctx.completion_tokens == 8 and ctx.prompt_tokens > 5
            texts.append(text)
        finally:
            await engine.close()
    assert texts[0] == texts[1]


async def test_transformers5_config_without_rope_theta(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "tiny-t5"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(config))
    engine = MistralRsEngine(resolve_card(str(folder), name="tiny"))
    await engine.start()
    try:
        text, _, ctx = await _collect(engine, {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                               "temperature": 0, "max_tokens": 4, "ignore_eos": True})
        assert ctx.completion_tokens == 4
        shadow = engine._shadow
        assert shadow is not None and shadow.is_dir()
    finally:
        await engine.close()
    assert not shadow.exists()
    assert json.loads((folder / "config.json").read_text()) == config  # the user's folder is untouched


def test_patch_rope() -> None:
    assert _patch_rope({"rope_theta": 1.0}) is None
    assert _patch_rope({"hidden_size": 8}) is None
    p = _patch_rope({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert p["rope_theta"] == 5e5 and p["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    p = _patch_rope({"text_config": {"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                                         "sliding_attention": {"rope_theta": 1e4}}}})
    assert p["text_config"]["rope_theta"] == 1e6


async def test_requests_are_served_one_at_a_time_and_cancel(tmp_path: Path) -> None:
    # a long context, so an uncancelled request would keep the worker busy for a long time
    folder = build_tiny_hf_model(tmp_path, name="tiny-long", max_position_embeddings=65536)
    engine = MistralRsEngine(resolve_card(str(folder), name="tiny"))
    await engine.start()
    try:
        raw = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
               "max_tokens": 6, "ignore_eos": True}
        results = await asyncio.gather(*(_collect(engine, raw) for _ in range(4)))
        assert len({r[0] for r in results}) == 1  # greedy: the same answer, none broken by the others
        # a consumer that stops after two chunks: the worker moves on to the next request at once
        # (60000 tokens would take about a minute here)
        ctx = Context()
        gen = engine.generate(parse_chat_request(dict(raw, max_tokens=60000)), ctx)
        got = [await gen.__anext__() for _ in range(2)]
        ctx.stop_generating()
        await gen.aclose()
        assert len(got) == 2
        t0 = time.monotonic()
        text, chunks, _ = await asyncio.wait_for(_collect(engine, raw), 60)
        assert text == results[0][0]
        assert time.monotonic() - t0 < 10
        # a queued request whose consumer is gone is skipped
        ctx = Context()
        ctx.stop_generating()
        text, chunks, _ = await _collect(engine, raw, ctx)
        assert text == ""
        # a bad request fails alone
        with pytest.raises(RequestError):
            await _collect(engine, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                    "tools": [{"type": "function", "function": {"name": "f"}}]})
        with pytest.raises(RequestError):
            await _collect(engine, dict(raw, messages=[{"role": "user", "content": "hello " * 66000}]))
        text, _, _ = await _collect(engine, raw)
        assert text == results[0][0]
        # completions, one chunk with the whole text
        text, chunks, ctx = await _collect(engine, {"model": "tiny", "prompt": "Hello", "temperature": 0,
                                                    "max_tokens": 5, "ignore_eos": True})
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and ctx.completion_tokens == 5
    finally:
        await engine.close()


async def test_load_failure_is_one_clear_line(tmp_path: Path, tiny_dir: Path) -> None:
    import shutil

    folder = tmp_path / "weird"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    config["model_type"] = "made_up"
    (folder / "config.json").write_text(json.dumps(config))
    engine = MistralRsEngine(resolve_card(str(folder), name="weird"))
    with pytest.raises(ModelError) as info:
        await engine.start()
    assert "\n" not in str(info.value) and "mistral.rs cannot load" in str(info.value)
    await engine.close()
