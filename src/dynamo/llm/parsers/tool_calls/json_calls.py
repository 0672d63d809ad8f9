"""The state machine shared by the formats that write calls as JSON after a start marker.

Text outside calls is content; a possible start marker split across deltas is held back (as stop
strings are), so no markup ever reaches ``content``.  Inside the calls region, separators are skipped
and each call is streamed with :class:`JsonCallStreamer` (or :class:`ArgsStreamer` where the format
names the function outside the JSON).  A "call" that turns out not to be one (not JSON, no name) is
given back as content, markup included, rather than dropped.
"""

from __future__ import annotations

from dynamo.llm.parsers.base import Delta, DeltaList, HeldBackParser, find_first, partial_marker
from dynamo.llm.parsers.json_call import ArgsStreamer, JsonCallStreamer

_TEXT, _REGION, _OBJ = 0, 1, 2


class JsonCallsParser(HeldBackParser):
    """Subclasses set the class attributes below (and may override :meth:`_call_head`)."""

    start_markers: tuple[str, ...] = ()
    bare_start: str | None = None  # a call may also open the output without a marker ('{' for Llama 3)
    region_end: str | None = None  # a marker that closes the calls region ('</tool_call>')
    skip: tuple[str, ...] = ()  # separators skipped between calls, besides whitespace

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._state = _TEXT
        self._raw = ""  # the current region's markup, given back as content if no call comes of it
        self._region_calls = 0
        self._streamer: JsonCallStreamer | None = None
        self._seen_text = False
        self._after_call = False

    def feed(self, text: str) -> list[Delta]:
        if (self._state == _TEXT and not self._buf and not self._after_call
                and (self._seen_text or self.bare_start is None)
                and not any(m[0] in text for m in self.start_markers)):
            return [{"content": text}] if text else []  # plain text, nothing held back: no call starts here
        return super().feed(text)

    # -- hooks
    def _call_head(self, buf: str, final: bool) -> tuple[str, int] | bool:
        """A call that names its function before the JSON: (name, length of the head), True to wait for
        more text, False if ``buf`` does not start one."""
        return False

    # -- the machine
    def _run(self, final: bool) -> list[Delta]:
        out = DeltaList()
        while True:
            if self._state == _TEXT:
                if not self._text(out, final):
                    break
            elif self._state == _REGION:
                if not self._region(out, final):
                    break
            elif not self._object(out, final):
                break
        return out.take()

    def _emit(self, out: DeltaList, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if text:
            if not self._seen_text and not text.isspace():
                self._seen_text = True
            out.content(text)

    def _text(self, out: DeltaList, final: bool) -> bool:
        buf = self._buf
        if self.bare_start is not None and not self._seen_text and self.calls == 0:
            stripped = buf.lstrip()
            if not stripped:
                if final:
                    self._emit(out, buf)
                    self._buf = ""
                return False
            if stripped.startswith(self.bare_start):
                self._raw = buf[: len(buf) - len(stripped)]
                self._buf = stripped
                self._state = _REGION
                self._region_calls = 0
                return True
            self._seen_text = True
        i, marker = find_first(buf, self.start_markers)
        if i != -1:
            self._emit(out, buf[:i])
            self._raw = marker
            self._buf = buf[i + len(marker):]
            self._state = _REGION
            self._region_calls = 0
            return True
        hold = 0 if final else partial_marker(buf, self.start_markers)
        self._emit(out, buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _region(self, out: DeltaList, final: bool) -> bool:
        buf = self._buf
        while True:
            stripped = buf.lstrip()
            self._raw += buf[: len(buf) - len(stripped)]
            buf = stripped
            if buf and not final and any(len(t) > len(buf) and t.startswith(buf) for t in self.skip):
                self._buf = buf
                return False  # maybe a separator split across deltas: wait for the rest
            for token in self.skip:
                if buf.startswith(token):
                    self._raw += token
                    buf = buf[len(token):]
                    break
            else:
                break
        self._buf = buf
        if not buf:
            if final and self._region_calls == 0:
                self._give_back(out, "")
            return False
        end = self.region_end
        if end is not None:
            if buf.startswith(end):
                self._buf = buf[len(end):]
                self._close_region(out)
                return True
            if end.startswith(buf) and not final:
                return False
        if buf[0] == "{":
            self._streamer = JsonCallStreamer()
            self._state = _OBJ
            return True
        head = self._call_head(buf, final)
        if head is True:
            if not final:
                return False
        elif head is not False:
            name, length = head
            self._raw += buf[:length]
            self._buf = buf[length:]
            out.call_start(self.calls, name)
            self.calls += 1
            self._streamer = ArgsStreamer(name)
            self._state = _OBJ
            return True
        # text that is not a call: the region is over
        if self._region_calls == 0:
            self._give_back(out, "")  # the marker was not a call's: content, and scan on as text
        else:
            self._state = _TEXT
            self._after_call = True
            self._raw = ""
        return True

    def _give_back(self, out: DeltaList, text: str) -> None:
        """No call came of this markup: it is content after all (what follows is scanned as text)."""
        out.content(self._raw + text)
        self._raw = ""
        self._seen_text = True
        self._after_call = False
        self._state = _TEXT

    def _close_region(self, out: DeltaList) -> None:
        if self._region_calls == 0:
            out.content(self._raw + (self.region_end or ""))
        self._raw = ""
        self._state = _TEXT
        self._after_call = self._region_calls > 0

    def _object(self, out: DeltaList, final: bool) -> bool:
        streamer = self._streamer
        assert streamer is not None
        buf, self._buf = self._buf, ""
        named = isinstance(streamer, ArgsStreamer)
        name, args = streamer.feed(buf)
        if name is not None:
            out.call_start(self.calls, name)
            self.calls += 1
        if args:
            out.call_args(self.calls - 1, args)
        if not streamer.done:
            if final and streamer.name is None:
                self._give_back(out, streamer.text)
            return False
        self._buf = streamer.rest
        self._streamer = None
        self._state = _REGION
        if streamer.name is None or (not named and not streamer.streamed_args):
            parsed = streamer.parsed()
            if streamer.name is None:
                if parsed is None:
                    self._give_back(out, streamer.text)
                    return True
                out.call_start(self.calls, parsed[0])
                self.calls += 1
            out.call_args(self.calls - 1, parsed[1] if parsed else "")
        self._region_calls += 1
        self._raw = ""
        return True

