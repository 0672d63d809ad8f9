"""``n`` > 1 through the openai SDK: one choice per index, streamed interleaved or unary, usage counting the
prompt once and every choice's completion; on echo_core (every choice the same echo) and on the real
SmolLM2 GGUF (sampled choices differ); a full engine that gives one choice refuses n > 1."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from harness.proc import DynamoRun

IGNORE_EOS = {"nvext": {"ignore_eos": True}}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def core(core_server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=core_server.api_url, api_key="unused", max_retries=0, timeout=30)


def test_n3_unary_chat(core: openai.OpenAI):
    one = core.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=5, extra_body=IGNORE_EOS)
    r = core.chat.completions.create(model="tiny-chat", messages=HELLO, n=3, max_tokens=5, extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in r.choices)
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens == 15


def test_n3_streamed_chat_and_completions(core: openai.OpenAI):
    stream = core.chat.completions.create(model="tiny-chat", messages=HELLO, n=3, max_tokens=4, stream=True,
                                          stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    texts, finishes, roles, usage = defaultdict(str), {}, defaultdict(int), None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
    assert finishes == {0: "length", 1: "length", 2: "length"} and dict(roles) == {0: 1, 1: 1, 2: 1}
    assert usage is not None and usage.completion_tokens == 12
    r = core.completions.create(model="tiny-chat", prompt="hello world", n=2, max_tokens=3, extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text


def test_n_out_of_range_and_full_engines(core: openai.OpenAI, full_server: DynamoRun):
    with pytest.raises(openai.BadRequestError) as e:
        core.chat.completions.create(model="tiny-chat", messages=HELLO, n=17)
    assert e.value.body["param"] == "n"  # type: ignore[index]
    full = openai.OpenAI(base_url=full_server.api_url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        full.chat.completions.create(model="echo", messages=HELLO, n=2)
    assert e.value.body["param"] == "n"  # type: ignore[index]


def test_logprobs_we_cannot_return_are_a_400(core: openai.OpenAI, full_server: DynamoRun):
    """echo_core and echo_full have no distribution to report: a 400, not nulls or made-up numbers."""
    full = openai.OpenAI(base_url=full_server.api_url, api_key="unused", max_retries=0, timeout=30)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            full.chat.completions.create(model="echo", messages=HELLO, logprobs=True, stream=stream)
        assert e.value.body["param"] == "logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        core.chat.completions.create(model="tiny-chat", messages=HELLO, logprobs=True, top_logprobs=2)
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        core.completions.create(model="tiny-chat", prompt="hi", logprobs=1)
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]
