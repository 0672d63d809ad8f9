"""Shared pieces of the response parsers: the delta collector, marker hold-back, call ids, the
feed/finish shape of a parser that holds text back.

A parser turns the post-processor's text stream into OpenAI chat deltas.  Each ``feed`` returns a list
of delta dicts, one per chunk to send: ``{"content": ...}``, ``{"reasoning_content": ...}`` or
``{"tool_calls": [entry]}``.  A tool call's first entry carries ``index``, ``id``, ``type`` and
``function.name`` (with empty arguments); later entries carry argument fragments, as OpenAI streams them.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any, Protocol

Delta = dict[str, Any]


def new_call_id() -> str:
    """``call_`` and 24 hex digits: the shape OpenAI's ids have, unique per call."""
    return "call_" + uuid.uuid4().hex[:24]


class DeltaList:
    """Collects deltas, merging neighbours of the same kind so one feed gives few chunks."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Delta] = []

    def content(self, text: str) -> None:
        self._text("content", text)

    def reasoning(self, text: str) -> None:
        self._text("reasoning_content", text)

    def _text(self, key: str, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and key in last:
            last[key] += text
        else:
            self.items.append({key: text})

    def call_start(self, index: int, name: str) -> None:
        entry = {"index": index, "id": new_call_id(), "type": "function",
                 "function": {"name": name, "arguments": ""}}
        self.items.append({"tool_calls": [entry]})

    def call_args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self.items[-1] if self.items else None
        if last is not None and "tool_calls" in last:
            entry = last["tool_calls"][-1]
            if entry["index"] == index and "id" not in entry:
                entry["function"]["arguments"] += fragment
                return
        self.items.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def extend(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if "content" in d:
                self.content(d["content"])
            elif "reasoning_content" in d:
                self.reasoning(d["reasoning_content"])
            else:
                self.items.append(d)

    def take(self) -> list[Delta]:
        out, self.items = self.items, []
        return out


def partial_marker(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        n = min(len(marker) - 1, len(buf))
        if n <= best:
            continue
        tail = buf[-n:]
        i = tail.find(marker[0])  # the earliest candidate start gives the longest suffix
        while i != -1 and n - i > best:
            if marker.startswith(tail[i:]):
                best = n - i
                break
            i = tail.find(marker[0], i + 1)
    return best


def find_first(buf: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest marker in ``buf``, or (-1, '')."""
    first, which = -1, ""
    for marker in markers:
        i = buf.find(marker)
        if i != -1 and (first == -1 or i < first):
            first, which = i, marker
    return first, which


class HeldBackParser(ABC):
    """A parser that holds text back in ``_buf`` until it can tell what the text is: ``feed`` adds to
    it and runs ``_run``, ``finish`` runs it once more with ``final`` set (no more text comes, so
    nothing may stay held). Subclasses write ``_run``; one with a fast path for text that needs no
    look writes ``feed`` and calls this one for the rest.
    """

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._run(False)

    def finish(self) -> list[Delta]:
        return self._run(True)

    @abstractmethod
    def _run(self, final: bool) -> list[Delta]:
        """The deltas for what ``_buf`` holds that can be told now (all of it when ``final``)."""


class ToolCallParser(Protocol):
    """Incremental tool-call extraction from the content stream."""

    calls: int  # tool calls started so far

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...
