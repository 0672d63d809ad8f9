"""Incremental detokenisation: turn a stream of token ids into text deltas.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and some tokenizers change how a token
renders depending on what precedes it (leading-space handling).  The fast path is ``tokenizers``'
``DecodeStream`` (Rust, one call per token, measured 2.6x faster than decoding a window twice in
Python), seeded with the end of the prompt so the first generated token renders as it would after the
prompt.  Where it raises (an id outside the vocabulary, a decoder it cannot stream) we switch, for the
rest of the stream, to the window method: decode the text already emitted and the text with the new ids,
and emit the difference once it no longer ends in U+FFFD (an incomplete character).  Both are kept
because the window method is also what ``flush`` needs: ``DecodeStream`` has no way to hand back the
bytes of an incomplete character at the end of a stream.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dynamo.llm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_KEEP = 64  # ids kept behind the last emitted one, for the fallback's window


class IncrementalDetokenizer:
    __slots__ = ("_tok", "_hf", "_stream", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, window: int = 5):
        self._tok = tokenizer
        tail = list(prompt_ids[-window:]) if prompt_ids else []
        self._ids: list[int] = tail
        # the window method's state; with DecodeStream it tracks what was emitted, for flush/fallback
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._hf = tokenizer.hf
        from tokenizers.decoders import DecodeStream  # loaded already (``tokenizer`` is one): a dict lookup

        try:
            self._stream: DecodeStream | None = DecodeStream(ids=tail, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - an old tokenizers without prefill ids: window method
            self._stream = None

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still incomplete)."""
        ids = self._ids
        ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                chunk = stream.step(self._hf, token_id)
            except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
                log.debug("DecodeStream failed (%s); window detokenizer for the rest of this stream", e)
                self._stream = None
                return self._window_step()
            if chunk is None:
                return ""
            # emitted through this id: keep offsets where the window method would have them
            self._prefix_offset = max(0, self._read_offset - 5) if self._read_offset else 0
            self._read_offset = len(ids)
            if self._read_offset > 2 * _KEEP:
                drop = self._read_offset - _KEEP
                del ids[:drop]
                self._read_offset -= drop
                self._prefix_offset = max(0, self._prefix_offset - drop)
            return chunk
        return self._window_step()

    def _window_step(self) -> str:
        ids = self._ids
        decode = self._tok.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset])
        new_text = decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            if self._prefix_offset > _KEEP:  # keep the window small: drop ids no longer needed
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
