"""Streaming one ``{"name": ..., "arguments": {...}}`` object as it is generated.

Hermes, Llama 3 JSON and Mistral all write a call as this JSON object (Llama 3 says ``parameters``).
Once ``{"name": "f", "arguments": `` has arrived the call's header is known, and the arguments object's
text is passed on as it comes, fragment by fragment, exactly as the model wrote it (it is JSON text,
which is what OpenAI's ``arguments`` string is).  Objects in another key order, or whose arguments are
not an object, are buffered and sent whole when the object is complete.
"""

from __future__ import annotations

import json
import re
from typing import Any

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class JsonCallStreamer:
    """Feed text that starts at the object's ``{``; ``done`` once its closing ``}`` arrived."""

    __slots__ = ("text", "name", "_depth", "_in_str", "_esc", "_pos", "_args_start", "_args_sent",
                 "_args_end", "_stream_args", "done", "rest")

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None  # set once the header is known (and the call announced)
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._pos = 0
        self._args_start = -1
        self._args_sent = -1
        self._args_end = -1
        self._stream_args = False
        self.done = False
        self.rest = ""  # text after the closing brace

    def feed(self, text: str) -> tuple[str | None, str]:
        """Add text; return (the name if it just became known, argument text to send now)."""
        self.text += text
        new_name = None
        if self.name is None:
            m = _HEADER.match(self.text)
            if m is not None:
                try:
                    self.name = json.loads('"' + m.group(1) + '"')
                except ValueError:
                    self.name = m.group(1)
                new_name = self.name
                self._args_start = m.end()
        self._scan()
        return new_name, self._args_ready()

    def _scan(self) -> None:
        text = self.text
        i = self._pos
        n = len(text)
        while i < n and not self.done:
            c = text[i]
            if (self._depth == 1 and not self._in_str and c in ",}" and self._args_start > 0
                    and self._args_end == -1 and i >= self._args_start):
                self._args_end = i  # the arguments value ended before this comma or brace
                # (never for ArgsStreamer, whose arguments are the whole object: _args_start == 0)
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    self.rest = text[i + 1 :]
                    self.text = text[: i + 1]
            i += 1
        self._pos = i

    def _args_ready(self) -> str:
        if self._args_start == -1:
            return ""
        text = self.text
        if self._args_sent == -1:
            j = self._args_start
            while j < len(text) and text[j].isspace():
                j += 1
            if j == len(text):
                return ""
            self._stream_args = text[j] == "{"
            self._args_sent = j
        if not self._stream_args:
            return ""
        end = self._args_end if self._args_end != -1 else self._pos
        while end > self._args_sent and text[end - 1].isspace() and (self._args_end != -1 or self._depth <= 1):
            end -= 1
        if end <= self._args_sent:
            return ""
        out = text[self._args_sent : end]
        self._args_sent = end
        return out

    def parsed(self) -> tuple[str, str] | None:
        """(name, arguments as a JSON string) of the complete object, or None if it is not a call."""
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        return call_of(obj)

    @property
    def streamed_args(self) -> bool:
        return self._stream_args


def call_of(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ArgsStreamer(JsonCallStreamer):
    """For formats that name the function outside the JSON (Mistral v11, DeepSeek V3): the whole
    object is the arguments, streamed as it arrives."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._args_start = 0

    def feed(self, text: str) -> tuple[str | None, str]:
        self.text += text
        self._scan()
        return None, self._args_ready()

    def parsed(self) -> tuple[str, str] | None:
        try:
            json.loads(self.text)
        except ValueError:
            return None
        return self.name or "", self.text
