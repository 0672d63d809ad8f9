"""llama.cpp's model and context for ``out=llamacpp``: loading them, the handles the other modules call
llama.cpp with, freeing them, and llama.cpp's own log.

One context holds ``n_parallel`` sequences with a cache stream each (``kv_unified`` off), so every sequence
has its own ``n_ctx_seq`` tokens of cache.  The handles are used by one thread at a time (the loading
thread, then the scheduler's: llama.cpp calls block and are not thread-safe).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.errors import ModelError, UserError

# KV cache types accepted for type_k / type_v (ggml_type values)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}

_QUIET_LOG: Any = None  # module-level on purpose: llama.cpp keeps calling it after an engine is gone


def silence_llama_log(L: Any) -> Any:
    """Send llama.cpp's log nowhere; returns the callback (mtmd's log takes it too).  The ctypes callback
    must outlive every engine: llama.cpp keeps the pointer, and a callback freed with its engine crashed
    the next model load in the same process."""
    global _QUIET_LOG
    if _QUIET_LOG is None:
        _QUIET_LOG = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
    return _QUIET_LOG


def kv_type(value: Any, name: str) -> int | None:
    """The ggml type of an engine argument ``type_k`` / ``type_v`` (None: llama.cpp's default)."""
    if value is None:
        return None
    t = KV_TYPES.get(str(value).lower())
    if t is None:
        raise UserError(f"--extra-engine-args: {name} must be one of {sorted(KV_TYPES)}, not {value!r}")
    return t


@dataclass
class Llama:
    """One loaded model and its context, with the modules that call them."""

    L: Any  # the llama_cpp module
    np: Any  # numpy
    model: Any
    lctx: Any
    vocab: Any
    mem: Any  # the context's memory (its KV cache)
    n_vocab: int
    batch: Any  # the one batch every step is built in
    threads: tuple[int, int]  # (n_threads, n_threads_batch) the context was created with


def load(path: Path, *, n_parallel: int, n_ctx_seq: int, n_batch: int, n_ubatch: int, n_gpu_layers: int,
         threads: int, threads_batch: int | None, type_k: int | None, type_v: int | None, flash_attn: Any,
         verbose: bool, use_extra_bufts: bool = True) -> Llama:
    """Load the GGUF and create a context of ``n_parallel`` sequences of ``n_ctx_seq`` tokens.

    ``use_extra_bufts=False`` keeps the weights out of llama.cpp's extra buffer types (the repacked layouts
    its AMX and AVX-512 kernels run on): what preflight.py falls back to where those kernels trap."""
    import llama_cpp as L
    import numpy as np

    if not verbose:
        silence_llama_log(L)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    if not use_extra_bufts:
        mparams.use_extra_bufts = False
    model = L.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelError(f"llama.cpp cannot load {path}: corrupt file or unsupported architecture "
                         "(run with -v to see llama.cpp's log)")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = n_ctx_seq * n_parallel
    cparams.n_seq_max = n_parallel
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_ubatch, n_batch)
    cparams.n_threads = threads
    cparams.n_threads_batch = threads_batch or threads
    cparams.kv_unified = False  # each sequence has its own n_ctx_seq tokens of cache
    cparams.no_perf = True
    if type_k is not None:
        cparams.type_k = type_k
    if type_v is not None:
        cparams.type_v = type_v
    if flash_attn is not None:
        cparams.flash_attn_type = 1 if flash_attn else 0
    lctx = L.llama_init_from_model(model, cparams)
    if not lctx:
        L.llama_model_free(model)
        raise ModelError(f"llama.cpp cannot create a context of {cparams.n_ctx} tokens for {path} "
                         "(out of memory? lower --context-length or n_parallel)")
    vocab = L.llama_model_get_vocab(model)
    return Llama(L=L, np=np, model=model, lctx=lctx, vocab=vocab, mem=L.llama_get_memory(lctx),
                 n_vocab=L.llama_vocab_n_tokens(vocab), batch=L.llama_batch_init(max(n_batch, n_parallel), 0, 1),
                 threads=(cparams.n_threads, cparams.n_threads_batch))


def free(llama: Llama) -> None:
    """Free the batch, the context and the model (the samplers first: the scheduler frees its own)."""
    L = llama.L
    L.llama_batch_free(llama.batch)
    L.llama_free(llama.lctx)
    L.llama_model_free(llama.model)
