"""Tokenize long prompts cheaply and off the event loop: a cache of tokenized segments.

Why: a frontend in front of KV-routed workers sees the same long texts again and again (a group's
system prompt, a conversation's history), and tokenizing them is the dearest thing it does per
request: 10 ms for a 17k-token prompt here, on the event loop, holding the GIL
(``tokenizers``' ``encode`` does; ``encode_batch`` does not).  With 8 clients that was three
quarters of the frontend's time (docs/routing.md, "Where the hits waited").

How: a rendered chat prompt is cut right after each *special* added token (``<|im_end|>``...).  The
Hugging Face tokenizer splits its input on added tokens before it normalizes and pre-tokenizes, and
tokenizes each piece on its own, so the pieces' ids, concatenated, are the ids of the whole, as long as:

* no special token strips the whitespace next to it (``lstrip``/``rstrip``/``single_word``) or is
  matched after normalization (``normalized``);
* no added token contains a special token inside it (the matcher would prefer the longer one);
* the pre-tokenizer does not treat the first piece differently (``Metaspace``, as in SentencePiece-style
  tokenizers, prepends a space to the first piece only), and the normalizer prepends nothing.

A tokenizer that breaks any of these is not cached (:func:`segmentable` says why).  For the others,
the first few cached encodings are checked against a plain one, and a mismatch turns the cache off with
a warning, so a tokenizer we misjudged costs time, never wrong ids.

Segments of at least ``min_chars`` characters are kept in an LRU bounded by the bytes it holds: each
entry's key (the segment's text), its ids and the map's own overhead, ``DYN_SEGMENT_CACHE_MB`` (default
16) in all.  It was bounded by tokens only (4M, "about 16 MB of ids"), but the keys are the texts, as big
as their ids or bigger: an entry of a 600-character segment of 150 tokens is 1,455 bytes, not 600
(tracemalloc), so the 4M-token bound held 35-40 MB, and a frontend whose prompts are all unique (the soak's mix)
filled it for hours.  16 MB holds some 2M tokens of long segments: a few hundred system prompts and
conversations.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Sequence

from dynamo.bounds import track

log = logging.getLogger(__name__)

DEFAULT_MIN_CHARS = 512
DEFAULT_BUDGET_MB = 16.0  # keys, ids and the map's overhead: ~2M tokens of long segments
BUDGET_ENV = "DYN_SEGMENT_CACHE_MB"
ENTRY_OVERHEAD = 72  # bytes an OrderedDict entry costs besides its key and value (slot, link node)
CHECKS = 3  # cached encodings verified against a plain encode before the cache is trusted


def segmentable(spec: dict[str, Any]) -> str | None:
    """None if prompts tokenized with this ``tokenizer.json`` may be cut after special tokens, else why not."""
    added = spec.get("added_tokens") or []
    special = [t for t in added if t.get("special")]
    if not special:
        return "it has no special tokens to cut at"
    for t in special:
        for flag in ("lstrip", "rstrip", "single_word"):
            if t.get(flag):
                return f"special token {t.get('content')!r} has {flag}"
        if t.get("normalized") and spec.get("normalizer"):
            return f"special token {t.get('content')!r} is matched after normalization"
    contents = [str(t.get("content", "")) for t in added]
    for s in special:
        sc = str(s.get("content", ""))
        if not sc:
            return "a special token is empty"
        if any(sc != c and sc in c for c in contents):
            return f"an added token contains special token {sc!r}"
    for part, name in ((spec.get("pre_tokenizer"), "pre-tokenizer"), (spec.get("normalizer"), "normalizer")):
        for kind in _types(part):
            if kind in ("Metaspace", "Prepend", "Precompiled"):
                return f"its {name} uses {kind}"
    return None


def _types(node: Any) -> list[str]:
    """Every ``type`` in a (nested) normalizer or pre-tokenizer spec."""
    if isinstance(node, dict):
        out = [str(node["type"])] if "type" in node else []
        for v in node.values():
            out += _types(v)
        return out
    if isinstance(node, list):
        return [t for v in node for t in _types(v)]
    return []


class SegmentCache:
    """Token ids of prompts, with the ids of their long segments remembered (thread-safe)."""

    def __init__(self, hf: Any, special_tokens: Sequence[str], *, min_chars: int = DEFAULT_MIN_CHARS,
                 budget_bytes: int | None = None):
        self._hf = hf
        # leftmost-longest, as the tokenizer's own matcher
        alternatives = sorted(set(special_tokens), key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(s) for s in alternatives))
        self.min_chars = min_chars
        self.budget_bytes = budget_from_env() if budget_bytes is None else budget_bytes
        self._lru: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._checks_left = CHECKS
        self.enabled = True
        self.hits = 0
        self.misses = 0
        track("segment_cache_entries", self, len)
        track("segment_cache_bytes", self, lambda c: c._bytes)

    def segments(self, text: str) -> list[str]:
        """``text`` cut right after each special token (the pieces join back to ``text``)."""
        out: list[str] = []
        start = 0
        for m in self._cut.finditer(text):
            out.append(text[start:m.end()])
            start = m.end()
        if start < len(text):
            out.append(text[start:])
        return out

    def encode(self, text: str, plain: Callable[[str], list[int]]) -> list[int]:
        """The ids of ``text``; ``plain`` tokenizes a whole text (for short texts and the checks)."""
        if not self.enabled or len(text) < self.min_chars:
            return plain(text)
        parts = self.segments(text)
        found: dict[int, array[int]] = {}
        with self._lock:
            for i, p in enumerate(parts):
                if len(p) >= self.min_chars:
                    known = self._lru.get(p)
                    if known is not None:
                        self._lru.move_to_end(p)
                        found[i] = known
        if not found:
            self.misses += 1
        else:
            self.hits += 1
        todo = [i for i in range(len(parts)) if i not in found]
        if todo:
            # one call for all the missing pieces; encode_batch releases the GIL while it works
            encs = self._hf.encode_batch([parts[i] for i in todo], add_special_tokens=False)
            for i, enc in zip(todo, encs, strict=True):
                found[i] = array("I", enc.ids)
            with self._lock:
                for i in todo:
                    if len(parts[i]) >= self.min_chars:
                        self._remember(parts[i], found[i])
        ids: list[int] = []
        for i in range(len(parts)):
            ids.extend(found[i])
        if self._checks_left > 0 and len(parts) > 1:
            return self._check(text, ids, plain)
        return ids

    def _remember(self, key: str, ids: array[int]) -> None:
        cost = _cost(key, ids)
        if key in self._lru or cost > self.budget_bytes:
            return
        self._lru[key] = ids
        self._bytes += cost
        while self._bytes > self.budget_bytes:
            old_key, old = self._lru.popitem(last=False)
            self._bytes -= _cost(old_key, old)

    def _check(self, text: str, ids: list[int], plain: Callable[[str], list[int]]) -> list[int]:
        """The ids of the whole text; if the pieces' differ, the cache goes off for good."""
        self._checks_left -= 1
        whole = plain(text)
        if whole != ids:
            self.enabled = False
            with self._lock:
                self._lru.clear()
                self._bytes = 0
            log.warning("tokenizing prompts piece by piece gave other ids than tokenizing them whole: "
                        "segment cache off for this tokenizer")
        return whole

    def __len__(self) -> int:
        return len(self._lru)


def _cost(key: str, ids: array[int]) -> int:
    """Bytes an entry holds: its key, its ids, the map's slot and link."""
    return sys.getsizeof(key) + sys.getsizeof(ids) + ENTRY_OVERHEAD


def budget_from_env() -> int:
    """``DYN_SEGMENT_CACHE_MB`` in bytes (0 caches nothing); a value that is not a number is warned about and
    the default used: a cache's knob never stops a frontend."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_BUDGET_MB
    except ValueError:
        log.warning("%s=%r is not a number of megabytes; using %g", BUDGET_ENV, raw, DEFAULT_BUDGET_MB)
        mb = DEFAULT_BUDGET_MB
    return max(0, int(mb * 2**20))
