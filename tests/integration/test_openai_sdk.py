"""The HTTP service through the official ``openai`` SDK, sync and async, streaming and unary.

``echo_full`` echoes the last user message (or the prompt) a character per chunk; ``echo_core`` echoes
the templated prompt's tokens through the real pre- and post-processor, so what comes back shows what
the template, tokenizer, detokenizer and stop handling did.
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from harness.proc import DynamoRun

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
IGNORE_EOS = {"nvext": {"ignore_eos": True}}


def templated(user: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def full(full_server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=full_server.api_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def core(core_server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=core_server.api_url, api_key="unused", max_retries=0, timeout=30)


def collect(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# -- /v1/models ------------------------------------------------------------------------------------


def test_models_lists_the_served_names(full: openai.OpenAI, core: openai.OpenAI):
    assert [m.id for m in full.models.list()] == ["echo"]
    models = list(core.models.list())
    assert [m.id for m in models] == ["tiny-chat"]
    assert models[0].object == "model"


# -- echo_full ---------------------------------------------------------------------------------------


def test_full_chat_unary(full: openai.OpenAI):
    r = full.chat.completions.create(model="echo", messages=[{"role": "user", "content": "Hello 🙂 world"}])
    assert r.object == "chat.completion"
    assert r.model == "echo"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Hello 🙂 world"
    assert r.choices[0].finish_reason == "stop"


def test_full_chat_streams_a_character_per_chunk(full: openai.OpenAI):
    stream = full.chat.completions.create(
        model="echo", messages=[{"role": "system", "content": "ignored"}, {"role": "user", "content": "héllo"}],
        stream=True,
    )
    text, chunks = collect(stream)
    assert text == "héllo"
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert contents == list("héllo")
    # the stream opens with a role-only chunk, as OpenAI's and vLLM's do; the role is on it only
    opening = chunks[0].choices[0]
    assert (opening.delta.role, opening.delta.content, opening.logprobs, opening.finish_reason) == (
        "assistant", "", None, None)
    assert chunks[1].choices[0].delta.content == "h"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)  # no usage unless asked for
    assert len({c.id for c in chunks}) == 1


def test_core_chat_stream_opens_with_a_role_only_chunk(core: openai.OpenAI, core_server: DynamoRun):
    """A token-level engine behind our pre/post-processing, streamed, and with n=2: each choice opens with
    ``{"role": "assistant", "content": ""}`` and ``logprobs`` null; its first token follows in a chunk of its own."""
    stream = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          stream=True, max_tokens=3, extra_body=IGNORE_EOS)
    _, chunks = collect(stream)
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert chunks[1].choices[0].delta.role is None and chunks[1].choices[0].delta.content
    raw = httpx.post(f"{core_server.api_url}/chat/completions", timeout=30, json={
        "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
        "max_tokens": 3, **IGNORE_EOS})
    events = [orjson.loads(line[6:]) for line in raw.text.splitlines()
              if line.startswith("data: {")]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0] == {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}
        assert "role" not in mine[1]["delta"] and mine[1]["delta"]["content"]


def test_full_chat_max_tokens_gives_length(full: openai.OpenAI):
    r = full.chat.completions.create(model="echo", messages=[{"role": "user", "content": "abcdef"}], max_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("abc", "length")


def test_full_completions_unary_and_stream(full: openai.OpenAI):
    r = full.completions.create(model="echo", prompt="once upon a time")
    assert r.object == "text_completion"
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("once upon a time", "stop")
    chunks = list(full.completions.create(model="echo", prompt="abc", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abc"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_full_stream_include_usage_gives_a_final_usage_chunk(full: openai.OpenAI):
    stream = full.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hey"}],
                                          stream=True, stream_options={"include_usage": True})
    text, chunks = collect(stream)
    assert text == "hey"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_full_async_client_concurrent_streams(full_server: DynamoRun):
    import asyncio

    client = openai.AsyncOpenAI(base_url=full_server.api_url, api_key="unused", max_retries=0, timeout=30)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": f"message number {i}"}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    results = await asyncio.gather(*(one(i) for i in range(8)))
    assert results == [f"message number {i}" for i in range(8)]
    r = await client.completions.create(model="echo", prompt="async unary")
    assert r.choices[0].text == "async unary"
    await client.close()


# -- echo_core ---------------------------------------------------------------------------------------


def test_core_chat_unary_echoes_the_templated_prompt(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi 🙂 café"}],
                                     extra_body=IGNORE_EOS)
    assert r.choices[0].message.content == templated("Hi 🙂 café")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens * 2


def test_core_chat_without_ignore_eos_stops_at_the_first_end_of_turn(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content == "<|im_start|>system\nYou are a helpful assistant."
    assert r.choices[0].finish_reason == "stop"


def test_core_chat_stream_multibyte_text_arrives_intact(core: openai.OpenAI):
    user = "emoji 🙂 and 🚀! 日本語のテキスト z🦀z"
    stream = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": user}],
                                          stream=True, extra_body=IGNORE_EOS)
    text, chunks = collect(stream)
    assert text == templated(user)
    assert not any("\ufffd" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_core_stream_usage_chunk(core: openai.OpenAI):
    stream = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                          stream=True, stream_options={"include_usage": True},
                                          max_tokens=4, extra_body=IGNORE_EOS)
    _, chunks = collect(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 4
    assert usage.prompt_tokens > 4
    assert usage.total_tokens == usage.prompt_tokens + 4
    assert usage.prompt_tokens_details is None  # the echo engine has no cache: no claim of 0 cached tokens
    assert chunks[-2].choices[0].finish_reason == "length"


def test_core_stop_string_trims_output_exactly(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     stop=["helpful"], extra_body=IGNORE_EOS)
    assert r.choices[0].message.content == "<|im_start|>system\nYou are a "
    assert r.choices[0].finish_reason == "stop"


def test_core_stop_string_streamed_never_leaks(core: openai.OpenAI):
    stream = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "find the needle here"}],
                                          stop=["needle"], stream=True, extra_body=IGNORE_EOS)
    text, chunks = collect(stream)
    assert text == SYSTEM + "<|im_start|>user\nfind the "
    assert "nee" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_core_max_tokens_gives_length(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=3, extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "<|im_start|>sy"


def test_core_max_completion_tokens(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     max_completion_tokens=2, extra_body=IGNORE_EOS)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 2)


def test_core_min_tokens_lets_generation_run_past_an_early_eos(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"min_tokens": 25})
    # the first <|im_end|> came before min_tokens, so it is ordinary text; the next one stops
    assert r.choices[0].message.content == SYSTEM + "<|im_start|>user\nHi"
    assert r.choices[0].finish_reason == "stop"


def test_core_stop_token_ids_are_hidden(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"ignore_eos": True, "stop_token_ids": [1]}, max_tokens=50)
    assert r.choices[0].message.content == ""  # the very first token is <|im_start|> (id 1)
    assert r.choices[0].finish_reason == "stop"


def test_core_completions_echo(core: openai.OpenAI):
    r = core.completions.create(model="tiny-chat", prompt="abc def", echo=True)
    assert r.choices[0].text == "abc defabc def"


def test_core_root_level_ignore_eos(core: openai.OpenAI):
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == templated("Hi")


def test_core_completions_prompt_is_raw(core: openai.OpenAI):
    r = core.completions.create(model="tiny-chat", prompt="Hello world, how are you?")
    assert r.choices[0].text == "Hello world, how are you?"  # no chat template around it
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == r.usage.completion_tokens


def test_core_completions_stop_and_max_tokens(core: openai.OpenAI):
    r = core.completions.create(model="tiny-chat", prompt="Hello world, how are you?", stop=" how")
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Hello world,", "stop")
    r = core.completions.create(model="tiny-chat", prompt="Hello world, how are you?", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 2
    assert "Hello world, how are you?".startswith(r.choices[0].text)


def test_core_completions_stream_with_usage(core: openai.OpenAI):
    chunks = list(core.completions.create(model="tiny-chat", prompt="naïve résumé", stream=True,
                                          stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "naïve résumé"
    assert chunks[-1].usage.completion_tokens > 0


def test_core_completions_token_ids(core: openai.OpenAI):
    r = core.completions.create(model="tiny-chat", prompt=[1, 2], extra_body=IGNORE_EOS)
    assert r.choices[0].text == "<|im_start|><|im_end|>"


def test_core_conversation_history_is_templated(core: openai.OpenAI):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "second"},
    ]
    r = core.chat.completions.create(model="tiny-chat", messages=messages, extra_body=IGNORE_EOS)
    assert r.choices[0].message.content == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nfirst<|im_end|>\n"
        "<|im_start|>assistant\nanswer one<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_core_tools_reach_the_template(core: openai.OpenAI):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Weather?"}],
                                     tools=tools, extra_body=IGNORE_EOS)
    assert '"name": "get_weather"' in r.choices[0].message.content


def test_core_template_raise_exception_is_a_400(core: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        core.chat.completions.create(model="tiny-chat", messages=[{"role": "function", "content": "x", "name": "f"}])
    assert "Unsupported message role: function" in e.value.message


def test_core_context_length_exceeded_is_a_400(core: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        core.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=5000)
    assert "maximum context length is 2048 tokens" in e.value.message


def test_unknown_model_is_not_found(core: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        core.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    assert "gpt-4" in e.value.message


async def test_core_async_stream_and_unary(core_server: DynamoRun):
    client = openai.AsyncOpenAI(base_url=core_server.api_url, api_key="unused", max_retries=0, timeout=30)
    stream = await client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "yo"}],
                                                  stream=True, extra_body=IGNORE_EOS)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == templated("yo")
    r = await client.completions.create(model="tiny-chat", prompt="The quick brown fox", max_tokens=50)
    assert r.choices[0].text == "The quick brown fox"
    await client.close()


def test_served_name_from_model_name_flag(tiny_model):
    with DynamoRun("out=echo_core", str(tiny_model), "--model-name", "my/model") as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["my/model"]
        r = client.completions.create(model="my/model", prompt="ok")
        assert r.model == "my/model"
        assert r.choices[0].text == "ok"
