"""The generic tool-call format's prompt (tool_calls/generic.py): what a template without tool support is given."""

from __future__ import annotations

import json

from dynamo.llm.parsers.registry import TOOL_CALL_PARSERS
from dynamo.llm.parsers.tool_calls.generic import GENERIC, INSTRUCTIONS, generic_tool_messages

TOOL = {"type": "function", "function": {"name": "f", "description": "does f",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def test_tools_go_into_a_system_message_before_the_conversation() -> None:
    out = generic_tool_messages([{"role": "user", "content": "hi"}], [TOOL])
    assert [m["role"] for m in out] == ["system", "user"]
    system = out[0]["content"]
    assert system.startswith(INSTRUCTIONS)
    listed = json.loads(system[len(INSTRUCTIONS):])
    assert listed == {"name": "f", "description": "does f", "parameters": TOOL["function"]["parameters"]}


def test_an_existing_system_message_keeps_its_text_after_the_tools() -> None:
    out = generic_tool_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                [TOOL])
    assert len(out) == 2 and out[0]["content"].endswith("\n\nBe brief.")


def test_history_calls_and_results_become_turns_the_template_knows() -> None:
    out = generic_tool_messages([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "4"},
    ], [TOOL])
    assert out[2] == {"role": "assistant", "content": '{"name": "f", "arguments": {"x": 1}}\n'
                                                      '{"name": "g", "arguments": {"y": 2}}'}
    assert out[3] == {"role": "user", "content": "Result of tool g: 4"}


def test_the_parser_reads_calls_and_leaves_prose() -> None:
    parser = TOOL_CALL_PARSERS[GENERIC]()
    deltas = parser.feed('{"name": "f", "arguments": {"x": 1}}\n{"name": "f", "arguments": {"x": 2}}') + \
        parser.finish()
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["f", "f"]
    prose = TOOL_CALL_PARSERS[GENERIC]()
    text = prose.feed("Sure, {x} is fine") + prose.finish()
    assert "".join(d.get("content", "") for d in text) == "Sure, {x} is fine"
