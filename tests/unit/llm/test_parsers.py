"""Tool-call and reasoning parsers on samples written from each format's documentation.

Every sample is parsed whole, split in two at every position, and fed a character at a time: the
result must be the same each time, and no markup may ever reach ``content`` (start tags are held back).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from dynamo.llm.parsers.fold import ParsedFold
from dynamo.llm.parsers.registry import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    detect_reasoning_parser,
    detect_tool_call_parser,
)
from dynamo.llm.parsers.stage import ResponseParser
from dynamo.llm.protocols.common import ResponseParsing

MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "<|channel|>",
          "<|message|>", "<|end|>", "<|start|>",
          "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "[ARGS]")


def run(make: Callable[[], Any], pieces: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    parser = make()
    deltas: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        deltas += parser.feed(piece, i == len(pieces) - 1) if isinstance(parser, ResponseParser) else parser.feed(piece)
    if not isinstance(parser, ResponseParser):
        deltas += parser.finish()
    fold = ParsedFold()
    content = []
    for d in deltas:
        assert len(d) == 1, d  # one kind per delta: one chunk each
        fold.add(d)
        if "content" in d:
            content.append(d["content"])
    msg = fold.message("".join(content))
    return msg, deltas


def splits(text: str) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out


def check(make: Callable[[], Any], text: str, content: str | None, calls: list[tuple[str, dict]],
          reasoning: str | None = None) -> None:
    expected = None
    for pieces in splits(text):
        msg, deltas = run(make, pieces)
        for d in deltas:
            for m in MARKUP:
                if m not in (content or ""):
                    assert m not in (d.get("content") or ""), (pieces, d)
        got = (
            msg["content"],
            msg.get("reasoning_content"),
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])],
        )
        assert got == (content, reasoning, calls), pieces
        for c in msg.get("tool_calls", []):
            assert c["id"].startswith("call_") and c["type"] == "function"
        expected = expected or got


def tools(name: str) -> Callable[[], Any]:
    return TOOL_CALL_PARSERS[name]


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {})


def test_hermes_text_then_two_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    check(tools("hermes"), text, "Let me check.\n", [WEATHER, TIME])


def test_hermes_plain_text_passes_through():
    check(tools("hermes"), "No tools needed: 2 < 3 and a <tag>.", "No tools needed: 2 < 3 and a <tag>.", [])


def test_hermes_not_json_is_given_back_as_content():
    text = "<tool_call>{\"name\": <function-name>}</tool_call> done"
    check(tools("hermes"), text, text, [])


def test_hermes_arguments_stream_in_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    _, deltas = run(tools("hermes"), list(text))
    entries = [d["tool_calls"][0] for d in deltas]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and entries[0]["index"] == 0
    assert len(entries) > 5  # one fragment per character fed once the name is known
    assert "".join(e["function"]["arguments"] for e in entries[1:]) == '{"city": "Paris", "unit": "celsius"}'
    assert all("id" not in e for e in entries[1:])


def test_hermes_string_arguments_and_other_key_order():
    text = ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}'
            '</tool_call><tool_call>{"arguments": {}, "name": "get_time"}</tool_call>')
    check(tools("hermes"), text, None, [WEATHER, TIME])


def test_hermes_truncated_call_at_the_end():
    msg, _ = run(tools("hermes"), ['<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'])
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    msg, _ = run(tools("hermes"), ["text <tool_call>"])
    assert msg["content"] == "text <tool_call>" and "tool_calls" not in msg


def test_llama3_json_bare_and_python_tag():
    text = ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {}}')
    check(tools("llama3_json"), text, None, [WEATHER, TIME])
    check(tools("llama3_json"), '<|python_tag|>{"name": "get_time", "parameters": {}}', None, [TIME])


def test_llama3_json_object_that_is_not_a_call_is_content():
    check(tools("llama3_json"), '{"answer": 4}', '{"answer": 4}', [])
    check(tools("llama3_json"), 'The answer is {"a": 1}', 'The answer is {"a": 1}', [])


def test_mistral_array_format():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {}}]')
    check(tools("mistral"), text, None, [WEATHER, TIME])


def test_mistral_v11_format():
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}'
    check(tools("mistral"), text, "Sure.", [WEATHER, TIME])


def test_deepseek_v3():
    text = ("I will look it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")
    check(tools("deepseek_v3"), text, "I will look it up.", [WEATHER, TIME])


def test_pythonic():
    check(tools("pythonic"), '[get_weather(city="Paris", unit="celsius"), get_time()]', None, [WEATHER, TIME])
    check(tools("pythonic"), '<|python_start|>[get_time()]<|python_end|>', None, [TIME])
    check(tools("pythonic"), "[1, 2] is a list", "[1, 2] is a list", [])
    check(tools("pythonic"), "Hello [there]", "Hello [there]", [])


def reasoning(name: str, started: bool | None = None, tool: str | None = None) -> Callable[[], Any]:
    return lambda: ResponseParser(ResponseParsing(tool_call_parser=tool, reasoning_parser=name,
                                                  reasoning_started=started))


def test_qwen3_reasoning_then_content():
    check(reasoning("qwen3"), "<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4.",
          "The answer is 4.", [], "Let me add.\n2+2=4")


def test_qwen3_without_think_is_all_content():
    check(reasoning("qwen3"), "The answer is 4.", "The answer is 4.", [])


def test_deepseek_r1_starts_in_reasoning_and_thinking_off_starts_in_content():
    check(reasoning("deepseek_r1"), "Hmm, 2+2.\n</think>\n\n4", "4", [], "Hmm, 2+2.")
    check(reasoning("deepseek_r1", started=False), "4, no thinking", "4, no thinking", [])
    check(reasoning("qwen3", started=True), "thinking</think>answer", "answer", [], "thinking")


def test_reasoning_then_tool_call():
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    check(reasoning("qwen3", tool="hermes"), text, None, [WEATHER], "I need the weather.")


def test_a_call_inside_reasoning_is_not_a_call():
    text = '<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>No call.'
    check(reasoning("qwen3", tool="hermes"), text, "No call.", [],
          'maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>')


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>')
    make = lambda: ResponseParser(ResponseParsing(tool_call_parser="hermes", parallel_tool_calls=False))  # noqa: E731
    check(make, text, None, [TIME])


def test_detection_from_chat_templates():
    assert detect_tool_call_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_call_parser("{% for tool in tools %}[TOOL_CALLS]{% endfor %}") == "mistral"
    assert detect_tool_call_parser("{{ tools }} <|python_tag|> ipython") == "llama3_json"
    assert detect_tool_call_parser("{{ tools }} <｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_tool_call_parser("{{ messages }}<|im_start|>") is None
    assert detect_reasoning_parser("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}") == "qwen3"
    assert detect_reasoning_parser("<｜Assistant｜><think>\n") == "deepseek_r1"
    assert detect_reasoning_parser("<|im_start|>") is None
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}


def test_forced_named_function_streams_the_output_as_arguments():
    from dynamo.llm.parsers.tool_calls.forced import NamedFunctionParser

    check(lambda: NamedFunctionParser("get_weather"), ' {"city": "Paris", "unit": "celsius"}', None, [WEATHER])
    _, deltas = run(lambda: NamedFunctionParser("get_weather"), ['{"city": ', '"Paris", ', '"unit": "celsius"}'])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) == 4


def test_forced_required_array():
    from dynamo.llm.parsers.tool_calls.forced import RequiredCallsParser

    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "parameters": {}}]'
    check(RequiredCallsParser, text, None, [WEATHER, TIME])


HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris", "unit": "celsius"}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>I have it.<|end|><|start|>assistant<|channel|>final<|message|>"
                  "It is 18 degrees.<|return|>")


def harmony(tool: str | None = "harmony", reasoning: str | None = "gpt_oss") -> Callable[[], Any]:
    return lambda: ResponseParser(ResponseParsing(tool_call_parser=tool, reasoning_parser=reasoning))


def test_harmony_reasoning_and_a_call():
    check(harmony(), HARMONY_CALL, None, [WEATHER], "The user wants the weather. Call the tool.")
    check(harmony(reasoning=None), HARMONY_CALL, None, [WEATHER], "The user wants the weather. Call the tool.")
    # the recipient before the channel, and no <|call|> (a hidden stop token)
    alt = ('<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary '
           'json<|message|>{}')
    check(harmony(), alt, None, [TIME], "Hmm.")


def test_harmony_final_answer_and_preamble():
    check(harmony(), HARMONY_ANSWER, "It is 18 degrees.", [], "I have it.")
    pre = "<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    check(harmony(), pre, "Checking now.Done.", [])


def test_harmony_without_tool_parsing_and_plain_text():
    msg, _ = run(harmony(tool=None), [HARMONY_CALL])
    assert msg["reasoning_content"] == "The user wants the weather. Call the tool."
    assert "tool_calls" not in msg and "to=functions.get_weather" in msg["content"]
    check(harmony(), "Just text.", "Just text.", [])
    assert detect_tool_call_parser("{{ tools }}<|start|>assistant<|channel|>final") == "harmony"
    assert detect_reasoning_parser("<|channel|>analysis") == "gpt_oss"
