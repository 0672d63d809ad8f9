"""Llama 3.1 / 3.2 JSON tool calls: the output *is* the call, optionally after ``<|python_tag|>``,
several separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Only an output that opens with ``{`` is taken for a call (vLLM does the same); a JSON object that has no
``name`` is content.
"""

from __future__ import annotations

from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser


class Llama3JsonParser(JsonCallsParser):
    start_markers = ("<|python_tag|>",)
    bare_start = "{"
    skip = (";",)
