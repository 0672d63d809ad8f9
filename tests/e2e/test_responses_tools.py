"""An agent loop on ``/v1/responses`` with the openai SDK: function tools -> a ``function_call`` item ->
the agent's ``function_call_output`` -> the final answer, unary and streaming, and the same second turn
through ``previous_response_id``.  ``in=http`` with the ``pytok:`` engine of tests/e2e/test_tool_calls.py,
which writes Qwen3's format (``<think>``, ``<tool_call>``) through the real Qwen3 tokenizer and chat
template, and answers the second turn only when the prompt holds the call and its result as the template
renders them.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from harness.qwen3 import require_qwen3_model_dir
from tests.e2e.test_tool_calls import ENGINE, MARKUP, EngineServer

pytestmark = pytest.mark.timeout(120)

MODEL = "qwen3-responses"
TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]},
}]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING = "The user wants the weather in Paris. I should call get_weather."
ARGS = {"city": "Paris", "unit": "celsius"}
FINAL = "It is 18 degrees in Paris."


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    folder = require_qwen3_model_dir()
    with EngineServer(f"out=pytok:{ENGINE}", str(folder), "--model-name", MODEL,
                      engine_args=("--", "--model-path", str(folder))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=30)


def result_for(call: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}


def check_first_turn(output: list[Any]) -> Any:
    """reasoning, then the sentence before the call, then the call: in the order the model wrote them."""
    assert [item.type for item in output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = output
    assert reasoning.content[0].text == REASONING and reasoning.id.startswith("rs_")
    assert message.content[0].text == "Let me check.\n"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == ARGS and call.status == "completed"
    return call


def test_agent_loop_unary(client: openai.OpenAI):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS)
    assert first.status == "completed"
    call = check_first_turn(first.output)
    assert first.tools[0].name == "get_weather"
    # the agent sends back everything it got, plus the tool's result (the SDK's own items, as agents do)
    second = client.responses.create(model=MODEL, input=[*QUESTION, *first.output, result_for(call)], tools=TOOLS)
    assert second.output_text == FINAL
    assert [i.type for i in second.output] == ["reasoning", "message"]
    assert second.output[0].content[0].text == "The user wants the weather in Paris. I have the result."


def test_agent_loop_through_previous_response_id(client: openai.OpenAI):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS)
    call = check_first_turn(first.output)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result_for(call)],
                                     tools=TOOLS)
    assert second.output_text == FINAL
    assert client.responses.retrieve(first.id).output[2].arguments == call.arguments
    (listed,) = client.responses.input_items.list(second.id).data  # this turn's input only
    assert listed.type == "function_call_output" and listed.call_id == call.call_id and listed.id


def test_the_call_alone_with_a_hand_written_history(client: openai.OpenAI):
    """An agent that keeps only the call (no reasoning, no text item) gets the same answer."""
    history = [*QUESTION, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": json.dumps(ARGS)},
               {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 18}'}]
    assert client.responses.create(model=MODEL, input=history, tools=TOOLS).output_text == FINAL


def test_agent_loop_streaming(client: openai.OpenAI):
    events = list(client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == [i.type for i in done] == ["reasoning", "message", "function_call"]
    assert added[2].arguments == "" and added[2].status == "in_progress" and added[2].name == "get_weather"
    # each item's events sit between its added and done, in the output order
    for index in range(len(done)):
        mine = [e.type for e in events if getattr(e, "output_index", None) == index]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"
        assert len(mine) > 4, mine  # the text and the arguments stream, they are not sent at the end
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert reasoning == REASONING and text == "Let me check.\n" and json.loads(arguments) == ARGS
    for m in MARKUP:
        assert m not in text + reasoning
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done.arguments == arguments and args_done.item_id == done[2].id
    final = events[-1].response
    call = check_first_turn(final.output)
    assert call.call_id == done[2].call_id

    second = list(client.responses.create(model=MODEL, input=[*QUESTION, *final.output, result_for(call)],
                                          tools=TOOLS, stream=True))
    assert "".join(e.delta for e in second if e.type == "response.output_text.delta") == FINAL
    assert second[-1].response.output_text == FINAL


def test_the_sdks_stream_helper_accumulates_our_events(client: openai.OpenAI):
    """``client.responses.stream`` rebuilds the response from the events as they come, and checks them."""
    with client.responses.stream(model=MODEL, input=QUESTION, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    call = check_first_turn(final.output)
    assert final.output_text == "Let me check.\n" and call.name == "get_weather"


def test_tool_choice_none_and_a_named_function(client: openai.OpenAI):
    r = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="none")
    assert r.output_text == "No tools here." and [i.type for i in r.output] == ["message"]
    # a named function goes through guided decoding: the output is that call, nothing else
    r = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGS


def test_built_in_tools_are_a_400_naming_them(server: EngineServer):
    body = {"model": MODEL, "input": "hi", "tools": [*TOOLS, {"type": "web_search_preview"}]}
    r = httpx.post(server.api_url + "/responses", json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools[1].type" and "web_search_preview" in err["message"]
