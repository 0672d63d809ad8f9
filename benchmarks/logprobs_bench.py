#!/usr/bin/env python3
"""Cost of logprobs on out=llamacpp (SmolLM2 GGUF): decode tokens/s of one greedy request at a time with no
logprobs, ``logprobs: true`` and ``top_logprobs: 20``, interleaved round by round so the machine's load
hits each kind alike; then the per-token pieces in-process (log-softmax over the vocabulary in numpy, and
the post-processor's entry for a token with 20 alternatives).

    PYTHONPATH=src .venv/bin/python -m benchmarks.logprobs_bench [--runs 7] [--tokens 64]

``--plain`` only times the post-processor of a request *without* logprobs (µs per token, 15 runs over
about 600 tokens, with a stop string): run it with ``PYTHONPATH`` on two checkouts to see what the
logprob hooks cost the plain path.  ``--echo``: a ~1,450-token completions prompt (fresh each time, so no
prefix cache), ``max_tokens`` 1, with and without ``logprobs: 5, echo: true``, two rounds: what prompt
logprobs cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openai

from harness.proc import DynamoRun
from harness.smollm2 import SMOLLM2_MODEL as MODEL
from harness.smollm2 import smollm2_gguf_or_exit as _smollm2


def pieces(repeat: int = 2000) -> None:
    from dynamo.engines.llamacpp.sampling import token_logprobs
    from dynamo.llm.gguf_card import load_gguf
    from dynamo.llm.logprobs import LogprobCarrier, token_bytes
    from dynamo.llm.tokenizer import Tokenizer

    tok = Tokenizer(load_gguf(_smollm2()).tokenizer_json)
    row = (np.random.default_rng(0).standard_normal(tok.vocab_size) * 8).astype(np.float32)
    for n in (0, 20):
        t0 = time.perf_counter()
        for i in range(repeat):
            token_logprobs(np, row, i, n)
        print(f"log-softmax + top {n:2d} over {tok.vocab_size} logits: {1e6 * (time.perf_counter() - t0) / repeat:6.1f} µs/token")
    tops = [{"token_id": int(t), "logprob": -float(k)} for k, t in enumerate(np.argsort(-row)[:20])]
    for n in (0, 20):
        carrier = LogprobCarrier(token_bytes(tok), n)
        t0 = time.perf_counter()
        for i in range(repeat):
            carrier.token(i % 5000, -0.5, tops, 3)
            carrier.release(3)
        print(f"post-processor entry, top {n:2d}: {1e6 * (time.perf_counter() - t0) / repeat:6.1f} µs/token")


def plain() -> None:
    from dynamo.llm.backend import PostProcessor
    from dynamo.llm.gguf_card import load_gguf
    from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest, StopConditions
    from dynamo.llm.tokenizer import Tokenizer

    tok = Tokenizer(load_gguf(_smollm2()).tokenizer_json)
    outs = [EngineOutput(token_ids=[i]) for i in tok.encode("The quick brown fox jumps over the lazy dog. " * 60)]
    res = []
    for _ in range(15):
        post = PostProcessor(tok, PreprocessedRequest(token_ids=[1, 2], stop_conditions=StopConditions(stop=["zz!"])))
        t0 = time.perf_counter()
        for o in outs:
            post.process(o)
        res.append(1e6 * (time.perf_counter() - t0) / len(outs))
    print(f"post-processor without logprobs: median {statistics.median(res):.2f} min {min(res):.2f} µs/token")


def echo() -> None:
    with DynamoRun("out=llamacpp", str(_smollm2()), startup_timeout=120) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", timeout=600)
        for i in range(2):
            for lp in (None, 5):
                prompt = f"Round {i} {lp}. " + "The history of the city is long and full of events. " * 120
                t0 = time.perf_counter()
                r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=lp,
                                              echo=lp is not None)
                print(f"round {i} logprobs={lp}: {time.perf_counter() - t0:.1f} s for {r.usage.prompt_tokens} "
                      "prompt tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--echo", action="store_true")
    args = ap.parse_args()
    if args.plain:
        plain()
        return
    if args.echo:
        echo()
        return
    pieces()
    with DynamoRun("out=llamacpp", str(_smollm2()), startup_timeout=120) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", timeout=120)
        msgs = [{"role": "user", "content": "Tell me a long story about a cat."}]
        kinds = {"none": {}, "logprobs": {"logprobs": True}, "top_logprobs=20": {"logprobs": True, "top_logprobs": 20}}
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(args.runs + 1):
            for name, extra in kinds.items():
                t0 = time.perf_counter()
                r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=args.tokens, temperature=0,
                                                   extra_body={"nvext": {"ignore_eos": True}}, **extra)
                dt = time.perf_counter() - t0
                if i:  # the first round warms up
                    rates[name].append(r.usage.completion_tokens / dt)
        base = statistics.median(rates["none"])
        for name, xs in rates.items():
            print(f"{name:16s} tokens/s median {statistics.median(xs):6.1f}  min {min(xs):6.1f}  max {max(xs):6.1f}"
                  f"  ratio to none {statistics.median(xs) / base:.2f}")


if __name__ == "__main__":
    main()
