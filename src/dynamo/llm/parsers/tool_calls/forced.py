"""Parsers for ``tool_choice`` ``required`` and a named function, where guided decoding made the output
JSON (the schemas are built in the pre-processor, as vLLM builds them):

- a named function: the whole output is that function's arguments object;
- ``required``: the output is ``[{"name": ..., "parameters": {...}}, ...]``.
"""

from __future__ import annotations

from typing import Any

from dynamo.llm.parsers.base import Delta, DeltaList
from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser


class NamedFunctionParser:
    """The output is the arguments of ``name``: the call is announced at once, the text streams as its
    arguments."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0
        self._begun = False

    def feed(self, text: str) -> list[Delta]:
        out = DeltaList()
        self._announce(out)
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        out.call_args(0, text)
        return out.take()

    def finish(self) -> list[Delta]:
        out = DeltaList()
        self._announce(out)
        return out.take()

    def _announce(self, out: DeltaList) -> None:
        if not self.calls:
            out.call_start(0, self.name)
            self.calls = 1


class RequiredCallsParser(JsonCallsParser):
    """A JSON array of call objects (``parameters`` or ``arguments``) from the first character."""

    bare_start = "["
    skip = ("[", ",", "]")


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The guided-decoding schema for a named function: its parameters."""
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """The guided-decoding schema for ``required``: a non-empty array of calls to the given tools."""
    choices = []
    for tool in tools:
        fn = tool.get("function") or {}
        choices.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn.get("name")]}, "parameters": named_schema(tool)},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if single:
        schema["maxItems"] = 1
    return schema
