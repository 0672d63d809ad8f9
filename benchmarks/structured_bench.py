#!/usr/bin/env python3
"""Cost of llama.cpp grammars (structured output) on out=llamacpp: decode tokens/s with and without a
JSON-schema constraint, one request at a time, on the SmolLM2 GGUF.

    PYTHONPATH=src .venv/bin/python -m benchmarks.structured_bench [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import openai

from harness.proc import DynamoRun
from harness.smollm2 import SMOLLM2_MODEL as MODEL
from harness.smollm2 import smollm2_gguf_or_exit as _smollm2

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "hobbies"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with DynamoRun("out=llamacpp", str(_smollm2()), startup_timeout=120) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", timeout=120)
        msgs = [{"role": "user", "content": "Describe a person with a name, an age and hobbies, as JSON."}]
        kinds = {"free": {}, "json_schema": {"response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "p", "schema": SCHEMA}}}}
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(args.runs + 1):
            for name, extra in kinds.items():
                t0 = time.perf_counter()
                r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0.8,
                                                   seed=i, **extra)
                dt = time.perf_counter() - t0
                if i:  # the first round warms up
                    rates[name].append(r.usage.completion_tokens / dt)
        for name, xs in rates.items():
            print(f"{name:12s} tokens/s median {statistics.median(xs):6.1f}  min {min(xs):6.1f}  max {max(xs):6.1f}")


if __name__ == "__main__":
    main()
