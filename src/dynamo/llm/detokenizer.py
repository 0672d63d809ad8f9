"""Incremental detokenisation: turn a stream of token ids into text deltas.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and some tokenizers change how a token
renders depending on what precedes it (leading-space handling).  So we decode a small window twice, the
text already emitted and the text with the new ids, and emit the difference only once it no longer ends
in U+FFFD (an incomplete character).  The window is seeded with the end of the prompt so the first
generated token renders as it would after the prompt.
"""

from __future__ import annotations

from dynamo.llm.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, window: int = 5):
        self._tok = tokenizer
        tail = list(prompt_ids[-window:]) if prompt_ids else []
        self._ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still incomplete)."""
        ids = self._ids
        ids.append(token_id)
        decode = self._tok.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset])
        new_text = decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            if self._prefix_offset > 64:  # keep the window small: drop ids no longer needed
                del ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end of the stream (an incomplete character decodes as U+FFFD)."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._tok.decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(ids[self._prefix_offset :])
        self._read_offset = len(ids)
        return new_text[len(prefix_text) :]
