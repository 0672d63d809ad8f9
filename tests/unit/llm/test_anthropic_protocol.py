"""A Messages request as the chat request it runs as: what each field becomes, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo.errors import RequestError
from dynamo.llm.protocols.anthropic import chat_request, parse_count_tokens_request, parse_messages_request
from dynamo.llm.stop_strings import StopStringMatcher


def chat(**body: Any) -> dict[str, Any]:
    return chat_request(parse_messages_request({"model": "m", "max_tokens": 50, **body}))


def test_a_whole_tool_loop_becomes_chat_messages():
    out = chat(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
               messages=[
                   {"role": "user", "content": "weather?"},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "call it", "signature": ""},
                       {"type": "redacted_thinking", "data": "xyz"},
                       {"type": "text", "text": "Let me check."},
                       {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris", "n": 1}}]},
                   {"role": "user", "content": [
                       {"type": "text", "text": "and hurry"},
                       {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18"}]},
                       {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True}]},
               ])
    assert out["messages"] == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "call it", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris", "n": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": "and hurry"},  # after the results it follows
    ]
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}
    assert out["chat_template_kwargs"] == {"enable_thinking": False}  # thinking only when asked for


def test_an_assistant_turn_that_only_calls_has_no_content():
    out = chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "w", "input": {}}]}])
    assert out["messages"][1]["content"] is None and out["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(("choice", "want", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}, None),
    ({"type": "none"}, "none", None),
])
def test_tools_and_tool_choice(choice: dict[str, Any], want: Any, parallel: bool | None):
    tools = [{"name": "w", "description": "d", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]
    out = chat(messages=[{"role": "user", "content": "q"}], tools=tools, tool_choice=choice)
    assert out["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                              "description": "d"}}]
    assert out["tool_choice"] == want and out.get("parallel_tool_calls") == parallel


def test_sampling_stop_thinking_metadata():
    out = chat(messages=[{"role": "user", "content": "q"}], temperature=0.2, top_p=0.5, top_k=3,
               stop_sequences=["X"], metadata={"user_id": "u"}, max_tokens=3000,
               thinking={"type": "enabled", "budget_tokens": 1024})
    assert {k: out[k] for k in ("temperature", "top_p", "top_k", "stop", "user", "max_tokens")} == {
        "temperature": 0.2, "top_p": 0.5, "top_k": 3, "stop": ["X"], "user": "u", "max_tokens": 3000}
    assert out["chat_template_kwargs"] == {"enable_thinking": True}


def test_count_tokens_takes_the_prompt_fields_only():
    req = parse_count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 9})
    out = chat_request(req)
    assert "max_tokens" not in out and out["messages"] == [{"role": "user", "content": "q"}]
    with pytest.raises(RequestError):
        parse_count_tokens_request({"model": "m", "messages": [], "stream": True})


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": "x"}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q", "citations": [{"a": 1}]}]}]},
     "messages.0.content.0.citations"),
    ({"messages": [{"role": "user", "content": "q"}], "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [{"name": "w", "input_schema": {}}]}, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "q"}], "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "q"}], "metadata": {"user_id": "u", "tenant": "t"}}, "metadata"),
    ({"messages": [{"role": "user", "content": "q"}], "thinking": {"type": "between_tools"}}, "thinking"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(body: dict[str, Any], param: str):
    with pytest.raises(RequestError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_the_stop_string_that_matched_is_known():
    m = StopStringMatcher(["a", "bb"])
    assert m.feed("xxb") == ("xx", False) and m.matched is None
    assert m.feed("ba") == ("", True) and m.matched == "bb"  # the earliest in the text, not the first listed


@pytest.mark.parametrize("field, value", [("temperature", 1.5), ("top_p", -0.1), ("temperature", float("nan"))])
def test_sampling_fields_out_of_anthropics_ranges_are_refused(field, value):
    """Anthropic's temperature stops at 1 (OpenAI's at 2): 1.5 is valid on the chat route, not here."""
    with pytest.raises(RequestError) as e:
        parse_messages_request({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                field: value})
    assert e.value.param == field


def test_sampling_fields_inside_the_ranges_pass_through():
    assert chat(messages=[{"role": "user", "content": "x"}], temperature=1.0, top_p=0.5)["temperature"] == 1.0
