"""``out=llamacpp``: llama.cpp through llama-cpp-python's low-level API, with continuous batching.

One model, one llama context holding ``n_parallel`` sequences.  A single scheduler thread owns every
llama.cpp call (they block and are not thread-safe): each step it admits waiting requests into free
sequence slots, builds one batch with a prompt chunk for requests still in prefill and one token for
each request in decode, runs ``llama_decode`` once, samples every sequence's next token, and hands the
tokens to the asyncio side in one ``call_soon_threadsafe``.  Requests join and leave between steps.

A slot keeps the KV cache of its last sequence; a new request goes to the free slot sharing the longest
prefix with its prompt, and only the tail after the shared prefix is computed again (multi-turn chats
and shared system prompts skip most of their prefill).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from dynamo.errors import EngineError, ModelError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)

DEFAULT_N_PARALLEL = 8
DEFAULT_MAX_CTX_PER_SEQ = 8192
ENGINE_ARGS = {"n_parallel", "n_threads", "n_threads_batch", "n_batch", "n_gpu_layers", "flash_attn",
               "type_k", "type_v", "seed"}


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    eos: frozenset[int]
    sampling: Any
    ctx: Context
    out: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False


@dataclass
class _Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence
    req: _Request | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    last: int = -1  # the token to feed next in decode
    generated: int = 0
    sampler: Any = None
    used_at: float = 0.0


class LlamaCppEngine:
    kind = "core"

    def __init__(self, gguf_path: Path, *, context_length: int, args: dict[str, Any] | None = None,
                 verbose: bool = False):
        args = dict(args or {})
        unknown = set(args) - ENGINE_ARGS
        if unknown:
            raise UserError(f"--extra-engine-args: unknown llamacpp argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(ENGINE_ARGS)}")
        self.path = gguf_path
        self.n_parallel = int(args.get("n_parallel", DEFAULT_N_PARALLEL))
        self.n_ctx_seq = context_length
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.n_threads = int(args.get("n_threads", cores))
        self.n_threads_batch = int(args.get("n_threads_batch", self.n_threads))
        self.n_batch = int(args.get("n_batch", 512))
        self.n_gpu_layers = int(args.get("n_gpu_layers", 0))
        self.flash_attn = args.get("flash_attn")
        self.verbose = verbose
        self._waiting: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._model = self._lctx = self._vocab = self._mem = None
        self._slots: list[_Slot] = []
        self._log_cb: Any = None

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="llamacpp-scheduler", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import llama_cpp as L

        self._L = L
        if not self.verbose:
            self._log_cb = L.llama_log_callback(lambda level, text, data: None)
            L.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = self.n_gpu_layers
        model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise ModelError(f"llama.cpp cannot load {self.path}: corrupt file or unsupported architecture "
                             "(run with -v to see llama.cpp's log)")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.n_ctx_seq * self.n_parallel
        cparams.n_seq_max = self.n_parallel
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(self.n_batch, 512)
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads_batch
        cparams.kv_unified = False  # each sequence has its own n_ctx_seq tokens of cache
        cparams.no_perf = True
        if self.flash_attn is not None:
            cparams.flash_attn_type = 1 if self.flash_attn else 0
        lctx = L.llama_init_from_model(model, cparams)
        if not lctx:
            L.llama_model_free(model)
            raise ModelError(f"llama.cpp cannot create a context of {cparams.n_ctx} tokens for {self.path} "
                             "(out of memory? lower --context-length or n_parallel)")
        self._model, self._lctx = model, lctx
        self._vocab = L.llama_model_get_vocab(model)
        self._mem = L.llama_get_memory(lctx)
        self._n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self._batch = L.llama_batch_init(max(self.n_batch, self.n_parallel), 0, 1)
        self._slots = [_Slot(seq_id=i) for i in range(self.n_parallel)]
        log.info("llama.cpp loaded %s: %d parallel sequences of %d tokens, %d threads",
                 self.path.name, self.n_parallel, self.n_ctx_seq, self.n_threads)

    async def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        if self._lctx is not None:
            L = self._L
            for slot in self._slots:
                if slot.sampler is not None:
                    L.llama_sampler_free(slot.sampler)
            L.llama_batch_free(self._batch)
            L.llama_free(self._lctx)
            L.llama_model_free(self._model)
            self._lctx = self._model = None

    # -- the asyncio side ---------------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        if self._thread is None:
            raise EngineError("llamacpp engine is not started")
        sc = request.stop_conditions
        prompt = list(request.token_ids)
        room = self.n_ctx_seq - len(prompt)
        if room <= 0:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {self.n_ctx_seq}")
        max_tokens = min(sc.max_tokens or room, room)
        eos = frozenset(request.eos_token_ids or ()) | frozenset(sc.stop_token_ids_hidden or ())
        if sc.ignore_eos:
            eos = frozenset(sc.stop_token_ids_hidden or ())
        loop = asyncio.get_running_loop()
        req = _Request(prompt, max_tokens, eos, request.sampling_options, context, asyncio.Queue(), loop)
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, EngineOutput):
                    yield item
                    if item.finish_reason is not None:
                        return
                else:
                    raise EngineError(str(item))
        finally:
            req.cancelled = True  # the scheduler frees the slot on its next step

    # -- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closing and not self._waiting and not any(s.req for s in self._slots):
                        self._cv.wait()
                    if self._closing:
                        break
                    self._admit()
                self._step()
        except Exception as e:  # never leave requests hanging if llama.cpp fails
            log.exception("llama.cpp scheduler failed")
            for slot in self._slots:
                if slot.req is not None:
                    self._deliver([(slot.req, f"llama.cpp failed: {e}")])
                    slot.req = None
        finally:
            self._fail_waiting("llamacpp engine is shutting down")

    def _fail_waiting(self, why: str) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        self._deliver([(r, why) for r in waiting])

    def _admit(self) -> None:
        """Move waiting requests into free slots, each to the slot sharing the longest prompt prefix."""
        while self._waiting:
            free = [s for s in self._slots if s.req is None]
            if not free:
                return
            req = self._waiting.popleft()
            if req.cancelled or req.ctx.is_stopped:
                continue
            best = max(free, key=lambda s: (_common_prefix(s.cached, req.prompt), -s.used_at))
            keep = min(_common_prefix(best.cached, req.prompt), len(req.prompt) - 1)
            L = self._L
            if not L.llama_memory_seq_rm(self._mem, best.seq_id, keep, -1):
                L.llama_memory_seq_rm(self._mem, best.seq_id, -1, -1)
                keep = 0
            best.cached = req.prompt[:keep]
            best.pending = req.prompt[keep:]
            best.req = req
            best.generated = 0
            if best.sampler is not None:
                L.llama_sampler_free(best.sampler)
            best.sampler = self._make_sampler(req.sampling)
            if keep:
                log.debug("request %s reuses %d cached prompt tokens", req.ctx.id, keep)

    def _make_sampler(self, so: Any) -> Any:
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        temperature = 1.0 if so.temperature is None else so.temperature
        rep, freq, pres = so.repetition_penalty, so.frequency_penalty, so.presence_penalty
        if (rep not in (None, 1.0)) or freq or pres:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(
                self._n_vocab, 64, float(rep or 1.0), float(freq or 0.0), float(pres or 0.0)))
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if so.top_k and so.top_k > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(so.top_k)))
        if so.top_p is not None and so.top_p < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(so.top_p), 1))
        if so.min_p:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(so.min_p), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(float(temperature)))
        seed = so.seed if so.seed is not None else int.from_bytes(os.urandom(4), "little")
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
        return chain

    def _finish(self, slot: _Slot) -> None:
        slot.req = None
        slot.pending = []
        slot.used_at = time.monotonic()

    def _step(self) -> None:
        L = self._L
        batch = self._batch
        n = 0
        outputs: list[tuple[_Slot, int]] = []  # (slot, batch index whose logits to sample)
        budget = self.n_batch
        # drop requests whose consumer went away or asked to stop
        for slot in self._slots:
            req = slot.req
            if req is not None and (req.cancelled or req.ctx.is_stopped):
                self._deliver([(req, EngineOutput(finish_reason="cancelled"))])
                self._finish(slot)
        # decode tokens first (one each), so running streams never wait behind a long prefill
        for slot in self._slots:
            if slot.req is not None and not slot.pending:
                _put(batch, n, slot.last, len(slot.cached), slot.seq_id, True)
                outputs.append((slot, n))
                slot.cached.append(slot.last)
                n += 1
                budget -= 1
        for slot in self._slots:
            if slot.req is None or not slot.pending or budget <= 0:
                continue
            take = slot.pending[:budget]
            last_chunk = len(take) == len(slot.pending)
            for i, tok in enumerate(take):
                want = last_chunk and i == len(take) - 1
                _put(batch, n, tok, len(slot.cached), slot.seq_id, want)
                if want:
                    outputs.append((slot, n))
                slot.cached.append(tok)
                n += 1
            slot.pending = slot.pending[len(take):]
            budget -= len(take)
        if n == 0:
            return
        batch.n_tokens = n
        rc = L.llama_decode(self._lctx, batch)
        if rc != 0:
            msg = f"llama_decode failed ({rc}): out of KV cache space" if rc == 1 else f"llama_decode failed ({rc})"
            failed = {id(s): s for s, _ in outputs}
            for slot in self._slots:
                if slot.req is not None and (id(slot) in failed or rc != 1):
                    self._deliver([(slot.req, msg)])
                    L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
                    slot.cached = []
                    self._finish(slot)
            return
        deliveries: list[tuple[_Request, Any]] = []
        for slot, idx in outputs:
            req = slot.req
            assert req is not None
            tok = L.llama_sampler_sample(slot.sampler, self._lctx, idx)
            slot.generated += 1
            slot.last = tok
            reason = None
            if tok in req.eos:
                reason = "eos"
            elif slot.generated >= req.max_tokens:
                reason = "length"
            deliveries.append((req, EngineOutput(token_ids=[tok], finish_reason=reason)))
            if reason is not None:
                self._finish(slot)
        self._deliver(deliveries)

    def _deliver(self, items: list[tuple[_Request, Any]]) -> None:
        if not items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, Any]]] = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, group)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _put_all(group: list[tuple[_Request, Any]]) -> None:
    for req, item in group:
        req.out.put_nowait(item)


def _put(batch: Any, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq_id
    batch.logits[i] = logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
