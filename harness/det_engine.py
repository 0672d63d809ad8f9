"""A deterministic token engine for fault tests (``out=pytok:harness/det_engine.py <hf folder>``).

The next token depends only on the previous one (:func:`next_token`), so a request that moved to another
worker mid-stream can be checked token for token: every word of the output must follow from the one
before it, and the count must be exactly ``max_tokens`` (nothing lost, nothing repeated).

The vocabulary is the model's tokens that are one space and a lowercase word (``Ġword`` in a byte-level
BPE), so each token decodes to `` word`` on its own. ``DET_TOKEN_DELAY_MS`` (default 20) paces tokens.
After the third token of a request it writes :data:`MID_GENERATION` to stderr, so a test can inject a fault
mid-generation (even of a unary request) once it sees that line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

DELAY_S = float(os.environ.get("DET_TOKEN_DELAY_MS", "20")) / 1000
WORDS: list[int] = []  # token ids of " word" tokens, in id order
MID_GENERATION = "det_engine: 3 tokens out"


def word_tokens(model_dir: str | Path) -> dict[int, str]:
    """id -> word (without the leading space) of the model's single-word tokens."""
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    return {i: tok[1:] for tok, i in vocab.items() if re.fullmatch(r"Ġ[a-z]{2,}", tok)}


def next_token(prev: int, words: list[int]) -> int:
    """The token after ``prev``: a fixed walk over ``words`` (any other token enters the walk)."""
    n = len(words)
    try:
        i = words.index(prev)
    except ValueError:
        return words[prev % n]
    return words[(i * 7 + 3) % n]


def initialize(args: list[str]) -> None:
    model = args[args.index("--model-path") + 1]
    WORDS.extend(sorted(word_tokens(model)))
    if len(WORDS) < 8:
        raise RuntimeError(f"{model}: too few single-word tokens for the deterministic engine")


async def generate(request):
    max_tokens = request["stop_conditions"].get("max_tokens") or 16
    prev = request["token_ids"][-1]
    for n in range(max_tokens):
        await asyncio.sleep(DELAY_S)
        prev = next_token(prev, WORDS)
        yield {"token_ids": [prev]}
        if n == 2:
            print(MID_GENERATION, file=sys.stderr, flush=True)
    yield {"token_ids": [], "finish_reason": "length"}
