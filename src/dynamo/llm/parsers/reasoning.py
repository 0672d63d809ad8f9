"""Reasoning parsers: ``<think>`` ... ``</think>`` text goes to ``reasoning_content``, the rest to
``content``.

``qwen3``: the output is content unless it opens with ``<think>`` (Qwen3 writes the tag itself; with
``enable_thinking: false`` its template closes an empty think block in the prompt).  ``deepseek_r1``: the
output is reasoning until ``</think>`` even without an opening tag (DeepSeek-R1's template puts
``<think>`` in the prompt).  Whatever the parser, a prompt that already ends inside ``<think>`` starts
in reasoning, and ``enable_thinking: false`` starts in content.  Newlines around the tags are dropped;
a tag split across deltas is held back, never shown.
"""

from __future__ import annotations

from dynamo.llm.parsers.base import Delta, DeltaList, HeldBackParser, partial_marker

_OPENING, _REASONING, _AFTER, _CONTENT = 0, 1, 2, 3


class ThinkParser(HeldBackParser):
    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, reasoning_first: bool):
        super().__init__()
        self._reasoning_first = reasoning_first
        self._state = _OPENING
        self._lead = True  # drop newlines that open the reasoning

    def feed(self, text: str) -> list[Delta]:
        if not self._buf and "<" not in text and not text.endswith("\n"):
            # the common case, mid-reasoning or mid-answer with nothing held back: no tag can be in it
            if self._state == _CONTENT:
                return [{"content": text}] if text else []
            if self._state == _REASONING and not self._lead:
                return [{"reasoning_content": text}] if text else []
        return super().feed(text)

    def _run(self, final: bool) -> list[Delta]:
        out = DeltaList()
        while self._buf:
            buf = self._buf
            if self._state == _OPENING:
                stripped = buf.lstrip()
                if stripped.startswith(self.start_tag):
                    self._buf = stripped[len(self.start_tag):]
                    self._state = _REASONING
                    continue
                if not final and (not stripped or self.start_tag.startswith(stripped)):
                    break
                self._state = _REASONING if self._reasoning_first else _CONTENT
                if self._state == _REASONING:
                    self._buf = stripped
                continue
            if self._state == _REASONING:
                if self._lead:
                    buf = buf.lstrip("\n")
                    if not buf:
                        self._buf = ""
                        break
                    self._lead = False
                i = buf.find(self.end_tag)
                if i != -1:
                    out.reasoning(buf[:i].rstrip("\n"))
                    self._buf = buf[i + len(self.end_tag):]
                    self._state = _AFTER
                    continue
                if final:
                    out.reasoning(buf)
                    self._buf = ""
                    break
                hold = partial_marker(buf, (self.end_tag,))
                body = buf[: len(buf) - hold]
                kept = body.rstrip("\n")
                out.reasoning(kept)
                self._buf = buf[len(kept):]
                break
            if self._state == _AFTER:
                buf = buf.lstrip("\n")
                self._buf = buf
                if not buf:
                    break
                self._state = _CONTENT
                continue
            out.content(buf)
            self._buf = ""
        if final and self._buf:
            out.content(self._buf)
            self._buf = ""
        return out.take()


def deepseek_r1(reasoning_first: bool = True) -> ThinkParser:
    return ThinkParser(reasoning_first)


def qwen3(reasoning_first: bool = False) -> ThinkParser:
    return ThinkParser(reasoning_first)
