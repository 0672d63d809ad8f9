"""OpenAI's harmony format (gpt-oss): the answer is a sequence of messages, each with a header naming its
channel, so one parser does reasoning and tool calls at once:

    <|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is 18 degrees.<|return|>

``analysis`` -> ``reasoning_content``; ``final`` and recipient-less ``commentary`` (preambles) ->
``content``; a message ``to=functions.NAME`` -> a tool call whose arguments stream as the body (the
recipient may also stand before ``<|channel|>``).  With tool parsing off, such a call is content, raw.
Headers are held back until ``<|message|>``; body ends (``<|end|>``, ``<|call|>``, ``<|return|>``) split
across deltas are held back too.  Output that does not open with a header is content.
"""

from __future__ import annotations

import re

from dynamo.llm.parsers.base import Delta, DeltaList, HeldBackParser, find_first, partial_marker

START, CHANNEL, MESSAGE, END, CALL, RETURN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser(HeldBackParser):
    def __init__(self, tools: bool = True):
        super().__init__()
        self.tools = tools
        self.calls = 0
        self._in_body = False
        self._kind = ""  # reasoning / content / call / raw
        self._raw_header = ""
        self._plain = False  # the output is not harmony at all

    def _run(self, final: bool) -> list[Delta]:
        out = DeltaList()
        while self._buf:
            if self._plain:
                out.content(self._buf)
                self._buf = ""
                break
            if not self._in_body:
                if not self._header(out, final):
                    break
            elif not self._body(out, final):
                break
        return out.take()

    def _header(self, out: DeltaList, final: bool) -> bool:
        buf = self._buf
        stripped = buf.lstrip()
        if not stripped.startswith((START, CHANNEL, "to=")) and not (
            not final and any(m.startswith(stripped) for m in (START, CHANNEL))
        ):
            self._plain = self.calls == 0 and not self._kind  # not harmony (or trailing text): content
            if not self._plain:
                out.content(buf)
                self._buf = ""
                return False
            return True
        i = buf.find(MESSAGE)
        if i == -1:
            if final:
                out.content(buf)  # a header with no message: give it back
                self._buf = ""
            return False
        header = buf[:i]
        self._buf = buf[i + len(MESSAGE):]
        self._in_body = True
        m = _CHANNEL.search(header)
        channel = m.group(1) if m else ""
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self.tools:
            self._kind = "call"
            out.call_start(self.calls, recipient.group(1))
            self.calls += 1
        elif recipient is not None:
            self._kind = "raw"
            out.content(header + MESSAGE)
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        return True

    def _body(self, out: DeltaList, final: bool) -> bool:
        buf = self._buf
        i, marker = find_first(buf, _ENDS)
        if i != -1:
            self._emit(out, buf[:i])
            if self._kind == "raw":
                out.content(marker)
            self._buf = buf[i + len(marker):]
            self._in_body = False
            return True
        hold = 0 if final else partial_marker(buf, _ENDS)
        self._emit(out, buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _emit(self, out: DeltaList, text: str) -> None:
        if self._kind == "reasoning":
            out.reasoning(text)
        elif self._kind == "call":
            out.call_args(self.calls - 1, text)
        else:
            out.content(text)
