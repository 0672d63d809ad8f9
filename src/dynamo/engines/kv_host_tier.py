"""A host-memory tier for llama.cpp slot caches (KV offloading): bounded in bytes, least recently used out.

When a slot's cached prefix is about to be overwritten, the engine saves the slot's sequence state here
(``llama_state_seq_get_data``: the KV of every cached token); a later request whose prompt shares a long
prefix with a saved entry gets it loaded back into a slot (``set_data``) instead of recomputing it.  On
this machine loading a state costs milliseconds where recomputing a prefix costs seconds
(docs/disaggregation.md).
"""

from __future__ import annotations

from collections import OrderedDict


def _common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HostKvTier:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self.bytes = 0
        self.saved = 0
        self.restored = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tokens: list[int], data: bytes) -> bool:
        """Keep the state of ``tokens``; False if it can never fit.  An entry that is a prefix of the new
        one is dropped (the new one covers it)."""
        if len(data) > self.max_bytes:
            return False
        key = tuple(tokens)
        for k in [k for k in self._items if len(k) <= len(key) and key[:len(k)] == k]:
            self.bytes -= len(self._items.pop(k))
        while self.bytes + len(data) > self.max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)
            self.evicted += 1
        self._items[key] = data
        self.bytes += len(data)
        self.saved += 1
        return True

    def best(self, prompt: list[int]) -> tuple[tuple[int, ...], int] | None:
        """The entry sharing the longest prefix with ``prompt``: (its tokens, shared length), or None."""
        best: tuple[tuple[int, ...], int] | None = None
        for key in self._items:
            n = _common_prefix(key, prompt)
            if n and (best is None or n > best[1]):
                best = (key, n)
        return best

    def get(self, key: tuple[int, ...]) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
        return data
