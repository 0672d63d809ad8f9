"""Stop-string matching that never lets any part of a stop string reach the client.

Text that could be the start of a stop string is held back until the next delta shows whether it is
one; held-back text that turns out innocent is released, and whatever remains at the end of the stream
is flushed.  The match can span any number of deltas.
"""

from __future__ import annotations


class StopStringMatcher:
    __slots__ = ("_stops", "_pending", "matched")

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None  # the stop string that matched (Anthropic's ``stop_sequence``)

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit, whether a stop string matched)."""
        buf = self._pending + text
        first = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (first == -1 or i < first):
                first = i
                self.matched = stop
        if first != -1:
            self._pending = ""
            return buf[:first], True
        hold = self._partial_suffix(buf)
        if hold:
            self._pending = buf[-hold:]
            return buf[:-hold], False
        self._pending = ""
        return buf, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
