"""llama.cpp called in this process through llama-cpp-python, for benchmarks/llamacpp_compare.py: the model's
end-of-generation tokens, and the ``llama_decode`` ceiling that no server can beat on this machine."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any


def eog_tokens(gguf: Path) -> list[int]:
    """The model's end-of-generation token ids, as llama.cpp sees them (vocab-only load)."""
    import ctypes

    import llama_cpp as L

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    p = L.llama_model_default_params()
    p.vocab_only = True
    model = L.llama_model_load_from_file(str(gguf).encode(), p)
    if not model:
        raise SystemExit(f"llama.cpp cannot load {gguf}")
    try:
        vocab = L.llama_model_get_vocab(model)
        return [t for t in range(L.llama_vocab_n_tokens(vocab)) if L.llama_vocab_is_eog(vocab, t)]
    finally:
        L.llama_model_free(model)


def raw_decode(gguf: Path, batches: list[int], threads: list[int], reps: int = 3, steps: int = 10,
               prompt: int = 30) -> dict[str, Any]:
    """The ceiling without any server: time ``llama_decode`` in this process for B sequences decoding
    together (one token each per step) and for their prompt (B x ``prompt`` tokens in one batch), with each
    thread count; thread counts and batch sizes are interleaved ``reps`` times, medians reported."""
    import ctypes

    import llama_cpp as L

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    n_seq = max(batches)
    cp.n_ctx = 1024 * n_seq
    cp.n_seq_max = n_seq
    cp.kv_unified = False  # as the engine runs it
    cp.n_threads = cp.n_threads_batch = threads[0]
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(512, n_seq * prompt), 0, 1)

    def put(i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    step_s: dict[tuple[int, int], list[float]] = {}
    prefill_s: dict[tuple[int, int], list[float]] = {}
    try:
        for _ in range(reps):
            for b in batches:
                for nt in threads:
                    L.llama_set_n_threads(ctx, nt, nt)
                    L.llama_memory_clear(mem, True)
                    n = 0
                    for seq in range(b):
                        for j in range(prompt):
                            put(n, 100 + j, j, seq, j == prompt - 1)
                            n += 1
                    batch.n_tokens = n
                    t = time.perf_counter()
                    assert L.llama_decode(ctx, batch) == 0
                    prefill_s.setdefault((nt, b), []).append((time.perf_counter() - t) / n)
                    times = []
                    for k in range(steps):
                        for seq in range(b):
                            put(seq, 200 + k, prompt + k, seq, True)
                        batch.n_tokens = b
                        t = time.perf_counter()
                        assert L.llama_decode(ctx, batch) == 0
                        times.append(time.perf_counter() - t)
                    step_s.setdefault((nt, b), []).append(statistics.median(times))
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    out = {}
    for (nt, b), v in step_s.items():
        step = statistics.median(v)
        out[f"threads={nt} batch={b}"] = {"step_ms": step * 1e3, "decode_tokens_per_s": b / step,
                                          "prefill_tokens_per_s": 1 / statistics.median(prefill_s[(nt, b)])}
    return out
