"""Tools for a model whose chat template shows no tool-call format: the generic JSON format, on all three APIs.

The server is ``echo_core`` with a template that renders only the last message: echo_core answers with the
prompt, so the "model" answers with what the user wrote.  A user message that is a call in the generic format
therefore comes back as the model's call, and goes through the generic parser exactly as a real model's would;
a prose message comes back as content.  What the generic prompt itself looks like is checked in
tests/unit/llm/test_generic_tools.py (the template here hides it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from harness.proc import DynamoRun

pytestmark = pytest.mark.timeout(120)

LAST_ONLY = "{{ messages[-1]['content'] }}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoRun]:
    template = tmp_path_factory.mktemp("tpl") / "last.jinja"
    template.write_text(LAST_ONLY)
    with DynamoRun("out=echo_core", str(tiny_model), "--model-name", "plain", "--chat-template", str(template),
                   "--enable-anthropic-api") as srv:
        yield srv


def sdk(srv: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=30)


def test_chat_call_in_the_generic_format_is_a_tool_call(server: DynamoRun) -> None:
    r = sdk(server).chat.completions.create(model="plain", messages=[{"role": "user", "content": CALL}],
                                            tools=[WEATHER])  # type: ignore[list-item]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert call.id.startswith("call_")


def test_chat_streamed_call_and_prose(server: DynamoRun) -> None:
    stream = sdk(server).chat.completions.create(model="plain", messages=[{"role": "user", "content": CALL}],
                                                 tools=[WEATHER], stream=True)  # type: ignore[list-item]
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    name = "".join(t.function.name or "" for d in deltas for t in d.tool_calls or [])  # type: ignore[union-attr]
    args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])  # type: ignore[union-attr]
    assert (name, json.loads(args)) == ("get_weather", {"city": "Paris"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    prose = sdk(server).chat.completions.create(model="plain", messages=[{"role": "user", "content": "Just hi"}],
                                                tools=[WEATHER])  # type: ignore[list-item]
    assert (prose.choices[0].message.content, prose.choices[0].message.tool_calls) == ("Just hi", None)
    assert prose.choices[0].finish_reason == "stop"


def test_a_conversation_with_an_earlier_call_and_its_result_renders(server: DynamoRun) -> None:
    """The history's assistant call and ``tool`` result reach a template that knows neither (as JSON and as a
    user turn); the model's next turn is then served as usual."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = sdk(server).chat.completions.create(model="plain", messages=messages, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert r.choices[0].message.content == "Result of tool get_weather: sunny"


def test_anthropic_messages_with_tools_are_served(server: DynamoRun) -> None:
    """Anthropic clients send tools with every request: a model without a tool-call format serves them."""
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0,
                                 timeout=30)
    tool = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER["function"]["parameters"]}
    msg = client.messages.create(model="plain", max_tokens=64, tools=[tool],  # type: ignore[list-item]
                                 messages=[{"role": "user", "content": CALL}])
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"})
    prose = client.messages.create(model="plain", max_tokens=64, tools=[tool],  # type: ignore[list-item]
                                   messages=[{"role": "user", "content": "Hello there"}])
    assert prose.stop_reason == "end_turn" and prose.content[0].text == "Hello there"  # type: ignore[union-attr]


def test_responses_with_tools_are_served(server: DynamoRun) -> None:
    r = httpx.post(f"{server.api_url}/responses", timeout=30, json={
        "model": "plain", "input": CALL,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]})
    assert r.status_code == 200, r.text
    (call,) = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
