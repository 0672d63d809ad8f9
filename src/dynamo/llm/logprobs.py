"""Token logprobs in OpenAI's shapes, and carrying them through the post-processor's hold-back.

An engine reports, per generated token, the chosen token's logprob (``EngineOutput.log_probs[i]``) and
alternatives (``top_logprobs[i]``: ``[{"token_id", "logprob"}]`` in any order, possibly including the
chosen one), and for ``echo`` the prompt's (``prompt_logprobs``: per prompt token ``None`` for the first,
else ``{"logprob", "top_logprobs"}``).  Here they become OpenAI chat entries ``{"token", "logprob",
"bytes", "top_logprobs"}``, the one internal shape: completions chunks are derived from it.

Why a carrier: the client must get each token's entry with the text that token produced.  The
detokenizer emits nothing for a token that ends inside a UTF-8 character (its entry waits for the next
token's text), the stop-string matcher holds text back (entries wait with it) and cuts a matched stop
string off (entries of tokens whose text was wholly cut are dropped; a token whose text was partly shown
keeps its entry).  ``bytes`` is the token's exact bytes; ``token`` is their UTF-8 text, with the bytes
of an incomplete character written as ``\\xNN`` escapes, as OpenAI writes them.
"""

from __future__ import annotations

import codecs
import json
import weakref
from collections import deque
from typing import Any

from dynamo.llm.tokenizer import Tokenizer

Entry = dict[str, Any]
MIN_LOGPROB = -9999.0  # OpenAI's floor for a token the model all but ruled out (JSON has no -inf)


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's, used by most BPEs)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(state: Any) -> set[str]:
    kinds: set[str] = set()
    if isinstance(state, dict):
        if isinstance(state.get("type"), str):
            kinds.add(state["type"])
        for sub in state.get("decoders") or ():
            kinds |= _decoder_kinds(sub)
        pattern = state.get("pattern")
        if state.get("type") == "Replace" and isinstance(pattern, dict) and pattern.get("String") == "\u2581":
            kinds.add("Metaspace")
    return kinds


class TokenBytes:
    """The exact bytes a token id stands for, from the tokenizer's vocabulary and decoder kind."""

    __slots__ = ("_hf", "_added", "_byte_level", "_byte_fallback", "_metaspace", "_cache", "_b2u")

    def __init__(self, tokenizer: Tokenizer):
        hf = tokenizer.hf
        self._hf = hf
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        try:
            kinds = _decoder_kinds(json.loads(hf.decoder.__getstate__())) if hf.decoder is not None else set()
        except (TypeError, ValueError, AttributeError):
            kinds = set()
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = "Metaspace" in kinds
        self._b2u = _unicode_to_byte() if self._byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """(``token`` as OpenAI writes it, ``bytes``), cached per id."""
        got = self._cache.get(token_id)
        if got is None:
            raw = self._bytes(token_id)
            got = self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return got

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            b2u = self._b2u
            if all(c in b2u for c in piece):
                return bytes(b2u[c] for c in piece)
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self._hf.decode([token_id], skip_special_tokens=False).encode()

    def entry(self, token_id: int, logprob: float | None, tops: list[dict[str, Any]] | None, n: int) -> Entry:
        """A chat ``logprobs.content`` entry; ``top_logprobs``: the ``n`` likeliest of ``tops``."""
        text, raw = self.piece(token_id)
        top: list[Entry] = []
        if n > 0 and tops:
            ranked = sorted(tops, key=lambda t: t["logprob"], reverse=True)[:n]
            for t in ranked:
                t_text, t_raw = self.piece(int(t["token_id"]))
                top.append({"token": t_text, "logprob": _clamp(t["logprob"]), "bytes": t_raw})
        return {"token": text, "logprob": _clamp(logprob), "bytes": raw, "top_logprobs": top}

    def prompt_entries(self, token_ids: list[int], raw: list[Any], n: int) -> list[Entry]:
        """Entries of the prompt tokens (``echo``): the first has ``logprob`` and ``top_logprobs`` None."""
        out = []
        for i, tid in enumerate(token_ids):
            item = raw[i] if i < len(raw) else None
            if item is None:
                text, b = self.piece(tid)
                out.append({"token": text, "logprob": None, "bytes": b, "top_logprobs": None})
            else:
                out.append(self.entry(tid, item.get("logprob"), item.get("top_logprobs"), n))
        return out


def _clamp(lp: Any) -> float | None:
    if lp is None:
        return None
    lp = float(lp)
    return lp if lp >= MIN_LOGPROB else MIN_LOGPROB  # also turns -inf and NaN into the floor


_TOKEN_BYTES: "weakref.WeakKeyDictionary[Tokenizer, TokenBytes]" = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """``tokenizer``'s :class:`TokenBytes`, built on first use (most requests never ask for logprobs)."""
    tb = _TOKEN_BYTES.get(tokenizer)
    if tb is None:
        tb = _TOKEN_BYTES[tokenizer] = TokenBytes(tokenizer)
    return tb


class LogprobCarrier:
    """One request's entries on their way through detokenization and stop-string hold-back.

    The post-processor reports each shown token's text length as the detokenizer produced it
    (:meth:`token`, :meth:`flushed`), then how much text it released (:meth:`release`); entries go out
    once all of their token's text has gone out."""

    __slots__ = ("_tb", "_n", "_pending", "_glue", "produced", "emitted", "item_index")

    def __init__(self, token_bytes: TokenBytes, n: int):
        self._tb = token_bytes
        self._n = n
        self._pending: deque[tuple[int, int, Entry]] = deque()  # (text start, text end, entry)
        self._glue: list[Entry] = []  # tokens that produced no text yet (inside a UTF-8 character)
        self.produced = 0
        self.emitted = 0
        self.item_index = 0  # the post-processor's position in the engine item it is reading

    def token(self, token_id: int, logprob: float | None, tops: list[dict[str, Any]] | None, n_chars: int) -> None:
        entry = self._tb.entry(token_id, logprob, tops, self._n)
        if n_chars == 0:
            self._glue.append(entry)
            return
        self._place(entry, n_chars)

    def flushed(self, n_chars: int) -> None:
        """The detokenizer's end-of-stream text (the rest of an incomplete character)."""
        if n_chars and self._glue:
            self._place(None, n_chars)
        else:
            self.produced += n_chars

    def _place(self, entry: Entry | None, n_chars: int) -> None:
        start = self.produced
        self.produced = end = start + n_chars
        for g in self._glue:
            self._pending.append((start, end, g))
        self._glue.clear()
        if entry is not None:
            self._pending.append((start, end, entry))

    def release(self, n_chars: int, final: bool = False, cut: bool = False) -> list[Entry]:
        """``n_chars`` more characters went to the client; the entries that go with them.  ``final``: the
        stream ends here; ``cut``: a stop string cut the rest of the text off."""
        self.emitted += n_chars
        pending = self._pending
        out = []
        while pending and pending[0][1] <= self.emitted:
            out.append(pending.popleft()[2])
        if final:
            if cut:  # a token partly shown keeps its entry; those wholly cut off are dropped
                out += [e for start, _, e in pending if start < self.emitted]
            else:
                out += [e for _, _, e in pending] + self._glue
            pending.clear()
            self._glue.clear()
        return out


class CompletionLogprobs:
    """The legacy completions shape, chunk after chunk of one choice: ``top_logprobs`` maps each of the
    likeliest tokens and the chosen one to its logprob (OpenAI's ``logprobs: N`` gives up to N+1);
    ``text_offset`` is each token's character offset in the choice's text (echoed prompt included),
    counted from the tokens' bytes so that a character split over two tokens counts once."""

    __slots__ = ("offset", "_utf8")

    def __init__(self) -> None:
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def shape(self, entries: list[Entry]) -> dict[str, Any]:
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, Any] | None] = []
        offsets: list[int] = []
        for e in entries:
            tokens.append(e["token"])
            lps.append(e["logprob"])
            top = e["top_logprobs"]
            if top is None:
                tops.append(None)
            else:
                d = {t["token"]: t["logprob"] for t in top}
                d.setdefault(e["token"], e["logprob"])
                tops.append(d)
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(bytes(e["bytes"])))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
