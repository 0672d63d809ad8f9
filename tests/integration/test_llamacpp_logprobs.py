"""Logprobs from llama.cpp for real (SmolLM2 GGUF), through the openai SDK: chat ``logprobs`` +
``top_logprobs`` unary and streamed, completions ``logprobs`` with ``echo`` (the prompt's logprobs), a
stop string cutting the stream, split UTF-8 characters; and the same through ``out=dyn`` (a worker
post-processes and sends the entries over real etcd/NATS and TCP).  Skipped like test_llamacpp.py when
the GGUF or llama-cpp-python is missing."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")

from harness.smollm2 import SMOLLM2_MODEL as MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ASK = [{"role": "user", "content": "What is 2+2?"}]


def check_entries(content: str, entries: list[Any], top: int) -> None:
    """What a client relies on: the entries spell the text, are logprobs, and rank alternatives."""
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == top
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        if top:
            assert e.logprob <= tops[0] + 1e-6  # nothing is likelier than the best alternative


def test_chat_logprobs_unary_and_streamed(smollm2_client):
    r = smollm2_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                               top_logprobs=3)
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert choice.finish_reason == "length" and len(entries) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == choice.message.content  # ASCII answer: tokens spell it
    check_entries(choice.message.content, entries, 3)
    # greedy: the chosen token is the most likely one of the model's distribution
    assert all(e.top_logprobs[0].token == e.token for e in entries)

    stream = smollm2_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8,
                                                    logprobs=True, top_logprobs=3, stream=True,
                                                    stream_options={"include_usage": True})
    text, streamed, usage = "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta, lp = chunk.choices[0].delta.content or "", chunk.choices[0].logprobs
        assert "".join(e.token for e in (lp.content if lp else [])) == delta  # each chunk: its own tokens
        text += delta
        streamed += lp.content if lp else []
    assert text == choice.message.content and usage is not None and len(streamed) == usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-3)


def test_each_of_n_choices_has_its_own_entries(smollm2_client):
    r = smollm2_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.8, seed=5, max_tokens=5, n=2,
                                               logprobs=True, top_logprobs=1,
                                               extra_body={"nvext": {"ignore_eos": True}})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 5
        check_entries(c.message.content, c.logprobs.content, 1)


def test_an_answer_ended_by_eos_has_no_entry_for_it(smollm2_client):
    r = smollm2_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=40, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    # usage counts the end-of-turn token; the client never sees it, so it has no entry
    assert len(choice.logprobs.content) == r.usage.completion_tokens - 1
    check_entries(choice.message.content, choice.logprobs.content, 0)


def test_completions_logprobs_with_echo(smollm2_client):
    prompt = "The capital of France is"
    plain = smollm2_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    echo = smollm2_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                             echo=True)
    lp, text = echo.choices[0].logprobs, echo.choices[0].text
    assert text == prompt + plain.choices[0].text and "".join(lp.tokens) == text
    assert len(lp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # up to N alternatives plus the chosen token, which is among them
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    n = echo.usage.prompt_tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-3)
    # the prompt is scored by the model: " Paris" after it is far likelier than " capital" after "The"
    assert plain.choices[0].logprobs.tokens[0] == " Paris"
    assert plain.choices[0].logprobs.token_logprobs[0] > lp.token_logprobs[1] + 5
    # a second time, with the prompt in llama.cpp's prefix cache: the same prompt logprobs
    again = smollm2_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                              echo=True)
    assert again.choices[0].logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:n], abs=1e-3)


def stream_with_stop(c: "openai.OpenAI") -> tuple[str, list[Any]]:
    stream = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=30, logprobs=True,
                                       top_logprobs=1, stop=[" problem is"], stream=True)
    text, entries, finish = "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta.content or ""
        got = choice.logprobs.content if choice.logprobs else []
        assert "".join(e.token for e in got) == delta
        text += delta
        entries += got
        finish = choice.finish_reason or finish
    assert finish == "stop"
    return text, entries


def test_a_stop_string_cuts_the_stream_and_its_tokens_entries(smollm2_client):
    text, entries = stream_with_stop(smollm2_client)
    # the answer goes "The answer to this classic math problem is 4." (greedy): the stop string's tokens
    # (" problem", " is") were held back, then cut with their entries
    assert text == "The answer to this classic math"
    assert [e.token for e in entries][-2:] == [" classic", " math"]
    check_entries(text, entries, 1)


def test_characters_split_over_tokens(smollm2_client):
    r = smollm2_client.chat.completions.create(model=MODEL,
                                               messages=[{"role": "user", "content": "Say hello in Japanese."}],
                                               temperature=0, max_tokens=20, logprobs=True)
    content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
    assert "\ufffd" not in content
    split = [e for e in entries if e.token.startswith("\\x")]
    assert split, "this answer has characters split over two tokens"
    assert all(len(bytes(e.bytes).decode("utf-8", errors="ignore")) < len(e.bytes) for e in split)
    check_entries(content, entries, 0)


def test_through_out_dyn(smollm2_dyn_client, smollm2_client):
    """The worker's post-processor carries the entries; the frontend passes them on: same as local."""
    text, entries = stream_with_stop(smollm2_dyn_client)
    local_text, local_entries = stream_with_stop(smollm2_client)
    assert text == local_text
    assert [e.token for e in entries] == [e.token for e in local_entries]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in local_entries], abs=1e-3)
    r = smollm2_dyn_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                              temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.token_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt's tokens have their alternatives too (2 asked for, plus the token itself)
    assert all(tok in top and 2 <= len(top) <= 3 for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
