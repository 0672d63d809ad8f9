"""The tokenizer of tests/conftest.py's tiny model folder, for the detokenizer, post-processor and logprobs
tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.llm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    """``tiny-chat``'s byte-level BPE tokenizer."""
    return Tokenizer((tiny_model / "tokenizer.json").read_text(encoding="utf-8"))
