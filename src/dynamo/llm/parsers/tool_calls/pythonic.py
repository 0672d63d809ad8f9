"""Pythonic tool calls (Llama 3.2 / 4 and others prompted with them): the output is a Python list of
calls with keyword arguments, optionally inside ``<|python_start|>`` ... ``<|python_end|>``:

    [get_weather(city="Paris", unit="celsius"), get_time()]

Arguments are Python literals (``True``, ``None``, nested lists/dicts), converted to JSON.  A list is
only known to be calls once it is complete, so calls are sent whole when the closing ``]`` arrives;
an output that does not open with ``[`` is content as it streams.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from dynamo.llm.parsers.base import Delta, DeltaList, HeldBackParser

_START = "<|python_start|>"
_END = "<|python_end|>"


class PythonicParser(HeldBackParser):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._mode = 0  # 0 undecided, 1 content, 2 inside a call list

    def _run(self, final: bool) -> list[Delta]:
        out = DeltaList()
        if self._mode == 3:  # after the calls: drop a closing <|python_end|>, the rest is content
            body = self._buf.lstrip()
            if not final and _END.startswith(body):
                return []
            if body.startswith(_END):
                self._buf = body[len(_END):]
            self._mode = 1
        if self._mode == 1:
            out.content(self._buf)
            self._buf = ""
            return out.take()
        body = self._buf.lstrip()
        if body.startswith(_START):
            body = body[len(_START):].lstrip()
        elif _START.startswith(body) and body and not final:
            return []
        if not body:
            if final:
                out.content(self._buf)
                self._buf = ""
            return out.take()
        if not body.startswith("["):
            self._mode = 1
            out.content(self._buf)
            self._buf = ""
            return out.take()
        self._mode = 2
        end = _list_end(body)
        if end == -1 and not final:
            return []
        calls = _calls(body[: end + 1]) if end != -1 else None
        if calls is None:
            self._mode = 1
            out.content(self._buf)
            self._buf = ""
            return out.take()
        for name, args in calls:
            out.call_start(self.calls, name)
            out.call_args(self.calls, args)
            self.calls += 1
        self._buf = body[end + 1 :]
        self._mode = 3
        out.extend(self._run(final))
        return out.take()


def _list_end(text: str) -> int:
    """Index of the ``]`` closing the list that ``text`` opens with, or -1."""
    depth = 0
    quote = ""
    esc = False
    for i, c in enumerate(text):
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _calls(text: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            args: dict[str, Any] = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None
