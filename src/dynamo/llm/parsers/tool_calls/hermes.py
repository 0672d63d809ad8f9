"""Hermes-style tool calls (Qwen 2.5 / Qwen3, Hermes 2/3, and many others):

    text before <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>
"""

from __future__ import annotations

from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser


class HermesParser(JsonCallsParser):
    start_markers = ("<tool_call>",)
    region_end = "</tool_call>"
