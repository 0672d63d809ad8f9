"""Tokenizer access through Hugging Face ``tokenizers`` (Rust; releases the GIL on batch calls only).

Prompts go through :meth:`Tokenizer.encode_prompt`: long ones are cut after special tokens and their
long pieces remembered (segment_cache.py), and :meth:`Tokenizer.encode_prompt_async` tokenizes a long
prompt in a thread, so that the event loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from dynamo.errors import ModelError
from dynamo.llm.segment_cache import SegmentCache, segmentable

log = logging.getLogger(__name__)

# prompts at least this long (characters; ~1,000 tokens, ~0.5 ms) are tokenized in a thread
OFF_LOOP_CHARS = 4096

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer



class Tokenizer:
    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer as _HFTokenizer  # here: a server without a tokenizer never loads it

        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelError(f"cannot load tokenizer: {e}") from None
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {tid for tid, tok in added.items() if tok.special}
        self.segments: SegmentCache | None = None
        try:
            why_not = segmentable(_spec(self._tok))
        except Exception as e:  # a component whose settings cannot be read: do not cut its prompts
            why_not = f"its settings cannot be read ({e})"
        if why_not is None:
            self.segments = SegmentCache(self._tok, [t.content for t in added.values() if t.special])
        else:
            log.debug("prompt segment cache off: %s", why_not)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        # the chat template already supplies BOS and friends, so no special tokens are added here
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """:meth:`encode`, reusing the ids of long pieces seen before (a system prompt, a history)."""
        if self.segments is None:
            return self.encode(text)
        return self.segments.encode(text, self.encode)

    async def encode_prompt_async(self, text: str) -> list[int]:
        """:meth:`encode_prompt`; a long prompt in a thread (the GIL is released while it tokenizes)."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode_prompt(text)
        return await asyncio.to_thread(self._encode_off_loop, text)

    def _encode_off_loop(self, text: str) -> list[int]:
        if self.segments is not None and self.segments.enabled:
            return self.segments.encode(text, self._encode_batch)
        return self._encode_batch(text)

    def _encode_batch(self, text: str) -> list[int]:
        # encode() holds the GIL for the whole text; encode_batch() gives it up
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def hf(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for ``DecodeStream``)."""
        return self._tok

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0



def _spec(tok: Any) -> dict[str, Any]:
    """What :func:`segmentable` reads, from the loaded tokenizer (parsing tokenizer.json again would take
    0.5 s for a 10 MB vocabulary): added tokens with their flags, normalizer and pre-tokenizer settings."""

    def settings(component: Any) -> Any:
        return None if component is None else json.loads(component.__getstate__())

    added = [{"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
              "single_word": t.single_word, "normalized": t.normalized}
             for t in tok.get_added_tokens_decoder().values()]
    return {"added_tokens": added, "normalizer": settings(tok.normalizer), "pre_tokenizer": settings(tok.pre_tokenizer)}
