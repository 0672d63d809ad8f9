"""Tokenizer access through Hugging Face ``tokenizers`` (Rust; releases the GIL on batch calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo.errors import ModelError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer

    from dynamo.llm.logprobs import TokenBytes


class Tokenizer:
    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer as _HFTokenizer  # here: a server without a tokenizer never loads it

        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelError(f"cannot load tokenizer: {e}") from None
        self._token_bytes: TokenBytes | None = None
        self._special_ids = {
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        }

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        # the chat template already supplies BOS and friends, so no special tokens are added here
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def hf(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for ``DecodeStream``)."""
        return self._tok

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's exact bytes, for logprob entries (built on first use: most requests never ask)."""
        if self._token_bytes is None:
            from dynamo.llm.logprobs import TokenBytes

            self._token_bytes = TokenBytes(self)
        return self._token_bytes
