"""``out=llamacpp --embedding``: sentence embeddings from a GGUF with llama.cpp.

A separate engine from the generating one (``engine.py``): its own model and context, created in
embedding mode.  The inputs of a request are decoded together, up to 16 sequences per ``llama_decode`` as
long as their tokens fit the context, with no vocabulary logits asked for.  The pooling is the model's own
(an embedding model's GGUF says mean, CLS or last); a model that declares none (a chat model) is pooled by
the mean of its token vectors, since the OpenAI API needs one vector per input.  Vectors are
L2-normalised, as llama-server's ``/v1/embeddings`` does.  Strings are tokenized by llama.cpp itself with
the model's special tokens (BOS where the model wants one), so the vector is the one ``Llama.embed`` gives
for the same text and pooling.  Every llama.cpp call runs on one thread (they block and are not
thread-safe); the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dynamo.engines.llamacpp import preflight
from dynamo.engines.llamacpp.model import silence_llama_log
from dynamo.errors import ModelError, RequestError, UserError
from dynamo.llm.embeddings import EmbeddingInput, Embeddings
from dynamo.llm.engine import Context

log = logging.getLogger(__name__)

DEFAULT_EMBED_CTX = 2048
MAX_SEQS_PER_BATCH = 16  # inputs decoded together (as long as their tokens fit the context)
ENGINE_ARGS = {"n_threads", "n_gpu_layers", "pooling"}
POOLING = {"mean": 1, "cls": 2, "last": 3}  # llama_pooling_type values
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


class LlamaCppEmbeddingEngine:
    kind = "embedding"

    def __init__(self, gguf_path: Path, *, context_length: int, args: dict[str, Any] | None = None,
                 verbose: bool = False):
        args = dict(args or {})
        unknown = set(args) - ENGINE_ARGS
        if unknown:
            raise UserError(f"--extra-engine-args: unknown llamacpp embedding argument(s) {sorted(unknown)}; "
                            f"valid with --embedding: {sorted(ENGINE_ARGS)}")
        pooling = args.get("pooling")
        if pooling is not None and pooling not in POOLING:
            raise UserError(f"--extra-engine-args: pooling must be one of {sorted(POOLING)}, got {pooling!r}")
        self.path = gguf_path
        self.n_ctx = context_length
        self.pooling: int | None = POOLING[pooling] if pooling else None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.n_threads = int(args.get("n_threads", cores))
        self.n_gpu_layers = int(args.get("n_gpu_layers", 0))
        self.verbose = verbose
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp-embed")
        # llama.cpp handles, set by _load on the llama.cpp thread
        self._L: Any = None
        self._model: Any = None
        self._lctx: Any = None
        self._batch: Any = None
        self._vocab: Any = None
        self._mem: Any = None
        self.dimensions = 0

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load)

    def _context(self, L: Any, pooling: int) -> Any:
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self.n_ctx
        cparams.n_ubatch = self.n_ctx  # a pooled input must fit in one micro-batch
        cparams.n_seq_max = MAX_SEQS_PER_BATCH
        cparams.kv_unified = True  # the sequences of a batch share the n_ctx cells
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.embeddings = True
        cparams.pooling_type = pooling
        cparams.no_perf = True
        lctx = L.llama_init_from_model(self._model, cparams)
        if not lctx:
            raise ModelError(f"llama.cpp cannot create an embedding context of {self.n_ctx} tokens for {self.path}")
        return lctx

    def _load(self) -> None:
        import llama_cpp as L

        self._L = L
        if not self.verbose:
            silence_llama_log(L)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = self.n_gpu_layers
        if self.n_gpu_layers == 0 and not preflight.require(self.path):
            mparams.use_extra_bufts = False
        self._model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelError(f"llama.cpp cannot load {self.path}: corrupt file or unsupported architecture")
        want = self.pooling if self.pooling is not None else L.LLAMA_POOLING_TYPE_UNSPECIFIED
        lctx = self._context(L, want)
        chosen = L.llama_pooling_type(lctx)
        if chosen not in POOLING.values():  # the model declares no pooling (or rank): mean it is
            L.llama_free(lctx)
            lctx = self._context(L, L.LLAMA_POOLING_TYPE_MEAN)
            log.info("%s declares no pooling; using mean pooling (pooling in --extra-engine-args to choose)",
                     self.path.name)
            chosen = L.LLAMA_POOLING_TYPE_MEAN
        self._lctx = lctx
        self._vocab = L.llama_model_get_vocab(self._model)
        self._mem = L.llama_get_memory(lctx)
        self.dimensions = L.llama_model_n_embd(self._model)
        self._batch = L.llama_batch_init(self.n_ctx, 0, 1)
        log.info("llama.cpp loaded %s for embeddings: %d dimensions, %s pooling, up to %d tokens per input",
                 self.path.name, self.dimensions, POOLING_NAMES.get(chosen, chosen), self.n_ctx)

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        if dimensions is not None and dimensions != self.dimensions:
            raise RequestError(f"This model does not support 'dimensions' (its vectors have {self.dimensions})",
                               param="dimensions")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._embed_all, inputs)

    # -- on the llama.cpp thread
    def _tokenize(self, text: str) -> list[int]:
        L = self._L
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, cap, True, True)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, cap, True, True)
        return list(buf[:n])

    def _embed_all(self, inputs: list[EmbeddingInput]) -> Embeddings:
        """Tokenize and check every input first (a bad one fails the request before any work), then
        decode them in batches of up to MAX_SEQS_PER_BATCH sequences that fit the context together."""
        n_vocab = self._L.llama_vocab_n_tokens(self._vocab)
        seqs: list[list[int]] = []
        for i, item in enumerate(inputs):
            ids = self._tokenize(item) if isinstance(item, str) else list(item)
            if not ids:
                raise RequestError(f"input {i} has no tokens", param="input")
            if len(ids) > self.n_ctx:
                raise RequestError(f"input {i} has {len(ids)} tokens; this model embeds at most {self.n_ctx} "
                                   "(raise it with --context-length)", param="input")
            bad = next((t for t in ids if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise RequestError(f"Token id {bad} is out of vocabulary (size {n_vocab})", param="input")
            seqs.append(ids)
        vectors: list[list[float]] = []
        group: list[list[int]] = []
        for ids in seqs:
            if group and (len(group) == MAX_SEQS_PER_BATCH or sum(map(len, group)) + len(ids) > self.n_ctx):
                vectors += self._embed_batch(group)
                group = []
            group.append(ids)
        if group:
            vectors += self._embed_batch(group)
        return Embeddings(vectors, sum(map(len, seqs)))

    def _embed_batch(self, seqs: list[list[int]]) -> list[list[float]]:
        L, batch = self._L, self._batch
        L.llama_memory_clear(self._mem, True)
        n = 0
        for seq_id, ids in enumerate(seqs):
            for pos, tok in enumerate(ids):
                batch.token[n] = tok
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = False  # pooled: llama.cpp reads every token anyway; no vocabulary logits
                n += 1
        batch.n_tokens = n
        rc = L.llama_decode(self._lctx, batch)
        if rc != 0:
            from dynamo.errors import EngineError

            raise EngineError(f"llama_decode failed with {rc}")
        out = []
        for seq_id in range(len(seqs)):
            ptr = L.llama_get_embeddings_seq(self._lctx, seq_id)
            vec = [float(ptr[j]) for j in range(self.dimensions)]
            norm = math.sqrt(sum(v * v for v in vec))
            out.append([v / norm for v in vec] if norm > 0 else vec)
        return out

    async def close(self) -> None:
        def free() -> None:
            L = getattr(self, "_L", None)
            if L is None:
                return
            if self._batch is not None:
                L.llama_batch_free(self._batch)
                self._batch = None
            if self._lctx:
                L.llama_free(self._lctx)
                self._lctx = None
            if self._model:
                L.llama_model_free(self._model)
                self._model = None

        await asyncio.get_running_loop().run_in_executor(self._pool, free)
        self._pool.shutdown(wait=False)
