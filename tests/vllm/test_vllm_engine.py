"""``dynamo-run in=http out=vllm`` for real: vLLM's CPU build serving a tiny random-weight Llama.

The vLLM tier: run by ``scripts/test-vllm.sh`` in ``.venv-vllm`` (``pytest -m vllm``); the default run
deselects it (pyproject's ``-m 'not vllm'``), and it skips itself where vLLM is not installed.

One server for the module (vLLM takes 20-60 s to start); it runs with ``enable_log_requests`` passed
through ``--extra-engine-args`` so vLLM itself logs the requests it aborts.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from harness.proc import DynamoRun, run_cli
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, serving, vllm_cache_env, vllm_tier

pytestmark = vllm_tier()

PROMPT = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("vllm-cache")
    return {
        **vllm_cache_env(cache),
        "DYN_LOG": "info,dynamo.engines.vllm.engine=debug",
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with random weights: 2 heads x head_dim 32 (a size vLLM's CPU attention has)."""
    return build_tiny_hf_model(tmp_path_factory.mktemp("vllm-models"))


@pytest.fixture(scope="module")
def server(model: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoRun]:
    extra = tmp_path_factory.mktemp("vllm-args") / "vllm_extra.json"
    extra.write_text(json.dumps({"enable_log_requests": True}))
    with serving(DynamoRun("out=vllm", str(model), "--context-length", "1024", "--extra-engine-args", str(extra),
                           env=vllm_env, startup_timeout=STARTUP_TIMEOUT), "vLLM server") as srv:
        yield srv
    assert "output_handler failed" not in srv.stderr_text()  # a clean shutdown of vLLM's client


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, max_tokens: int, **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="tiny-chat", messages=PROMPT, max_tokens=max_tokens, temperature=0,
                                          **kw)


def test_model_is_listed_with_vllms_context_length(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]


def test_an_image_to_a_text_model_is_a_400(client: openai.OpenAI) -> None:
    """A vLLM model without a vision encoder announces no images (tests/vllm/test_vllm_images.py serves
    one that has): an image is refused in the API's shape, never dropped, and the server keeps serving."""
    url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    with pytest.raises(openai.BadRequestError, match="does not accept images"):
        client.chat.completions.create(model="tiny-chat", max_tokens=2, messages=[{"role": "user", "content": [  # type: ignore[misc,list-item]
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}])
    assert greedy(client, 2).choices[0].message.content


def test_streaming_chat_returns_tokens_and_length(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny-chat", messages=PROMPT, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content, chunks
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 0


def test_unary_chat(client: openai.OpenAI) -> None:
    resp = greedy(client, 8, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.usage.completion_tokens == 8


def test_greedy_is_deterministic(client: openai.OpenAI) -> None:
    a = greedy(client, 12, extra_body={"ignore_eos": True}).choices[0].message.content
    b = greedy(client, 12, extra_body={"ignore_eos": True}).choices[0].message.content
    assert a == b


def test_completions_endpoint(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny-chat", prompt="The quick brown fox", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6


def test_stop_string_from_the_models_own_output(client: openai.OpenAI) -> None:
    full = greedy(client, 48, extra_body={"ignore_eos": True}).choices[0].message.content
    # a stop string the model really produces: an ASCII word-ish run that first occurs after the start
    candidates = [m for m in re.finditer(r"[A-Za-z]{2,}", full) if m.start() > 0]
    if not candidates:
        pytest.skip(f"the random model's greedy output has no ASCII run to stop on: {full!r}")
    match = candidates[0]
    stop = match.group(0)
    cut = full.index(stop)
    resp = greedy(client, 48, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == full[:cut]
    # streamed, nothing of the stop string reaches the client either
    stream = client.chat.completions.create(model="tiny-chat", messages=PROMPT, max_tokens=48, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full[:cut]


def _aborted_count(server: DynamoRun) -> int:
    return len(re.findall(r"Aborted request", server.stderr_text()))


def test_cancelled_stream_is_aborted_in_vllm(client: openai.OpenAI, server: DynamoRun) -> None:
    before = _aborted_count(server)
    stream = client.chat.completions.create(model="tiny-chat", messages=PROMPT, max_tokens=900, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got >= 3:
                break
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _aborted_count(server) <= before:
        time.sleep(0.2)
    log = server.stderr_text()
    assert _aborted_count(server) > before, log[-4000:]
    assert "vllm: aborting request" in log
    # and the server keeps serving
    resp = greedy(client, 4, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4


def test_max_tokens_beyond_the_context_is_capped(client: openai.OpenAI) -> None:
    # --context-length 1024 became vLLM's max_model_len: a request may not ask for more than fits
    with pytest.raises(openai.BadRequestError):
        greedy(client, 5000)


def test_unknown_extra_engine_arg_is_one_clear_error(model: Path, vllm_env: dict[str, str], tmp_path: Path) -> None:
    extra = tmp_path / "bad.json"
    extra.write_text(json.dumps({"no_such_engine_argument": 1}))
    proc = run_cli(["in=none", "out=vllm", str(model), "--extra-engine-args", str(extra)], env=vllm_env,
                   timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "no_such_engine_argument" in errors[0] and str(extra) in errors[0]
    assert "Traceback" not in proc.stderr


def test_logprobs_unary_and_streamed(client: openai.OpenAI) -> None:
    """vLLM's logprobs reach the client (they were once dropped): entries spell the text, and
    under greedy decoding the chosen token is the likeliest of vLLM's raw distribution."""
    r = greedy(client, 6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 6
    # a random model writes invalid UTF-8 too: the bytes are exact, the text has U+FFFD where they are invalid
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].token == e.token for e in entries)
    stream = client.chat.completions.create(model="tiny-chat", messages=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-3)


def test_completions_echo_gives_vllms_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == n + r.usage.completion_tokens and r.choices[0].text.startswith(prompt)
    assert "".join(lp.tokens[:n]) == prompt
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))


def test_structured_outputs_constrain_the_random_model(client: openai.OpenAI) -> None:
    """guided_choice, guided_regex and response_format json_schema through vLLM's structured outputs:
    a random-weight model's output obeys them, so the constraint did the work."""
    r = greedy(client, 10, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = greedy(client, 10, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", r.choices[0].message.content)
    schema = {"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}}, "required": ["sky"],
              "additionalProperties": False}
    r = greedy(client, 40, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert json.loads(text)["sky"] in ("blue", "grey")
    else:  # cut by max_tokens (a random model may pad with whitespace): still the schema's beginning
        assert text.lstrip().startswith("{")
