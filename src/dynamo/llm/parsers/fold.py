"""Folding parsed deltas into a unary chat message: ``reasoning_content`` joined, tool-call entries
merged by index (the id, type and name from the first, the arguments concatenated)."""

from __future__ import annotations

from typing import Any


class ParsedFold:
    __slots__ = ("_reasoning", "_calls")

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: dict[str, Any] | None) -> None:
        if not delta:
            return
        reasoning = delta.get("reasoning_content")
        if reasoning:
            self._reasoning.append(reasoning)
        for entry in delta.get("tool_calls") or ():
            call = self._calls.get(entry["index"])
            fn = entry.get("function") or {}
            if call is None:
                call = {"id": entry.get("id"), "type": entry.get("type", "function"),
                        "function": {"name": fn.get("name"), "arguments": ""}}
                self._calls[entry["index"]] = call
            call["function"]["arguments"] += fn.get("arguments") or ""

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message: content is null when the answer is only tool calls (as OpenAI's)."""
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self._reasoning:
            msg["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            msg["content"] = text or None
            msg["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return msg
