"""Mistral tool calls, both generations of the format:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v3 tokenizer)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}            (v11 and later)
"""

from __future__ import annotations

import re

from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser

_HEAD = re.compile(r"([A-Za-z_][A-Za-z0-9_\-.]*)\[ARGS\]")
_PARTIAL = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*(\[(A(R(G(S)?)?)?)?)?")


class MistralParser(JsonCallsParser):
    start_markers = ("[TOOL_CALLS]",)
    skip = ("[TOOL_CALLS]", "[", ",", "]")

    def _call_head(self, buf: str, final: bool) -> tuple[str, int] | bool:
        m = _HEAD.match(buf)
        if m is not None:
            return m.group(1), m.end()
        p = _PARTIAL.fullmatch(buf)
        return p is not None and not final
