"""``out=llamacpp``: llama.cpp through llama-cpp-python's low-level API, with continuous batching.

One model, one llama context holding ``n_parallel`` sequences.  A single scheduler thread owns every
llama.cpp call (they block and are not thread-safe): each step it admits waiting requests into free
sequence slots, builds one batch with a prompt chunk for requests still in prefill and one token for
each request in decode, runs ``llama_decode`` once, samples every sequence's next token, and hands the
tokens to the asyncio side in one ``call_soon_threadsafe``.  Requests join and leave between steps.

A slot keeps the KV cache of its last sequence; a new request goes to the free slot sharing the longest
prefix with its prompt, and only the tail after the shared prefix is computed again (multi-turn chats
and shared system prompts skip most of their prefill).  When a *busy* slot shares a clearly longer
prefix (a group of users on one system prompt, sent here together by a KV router), that slot's cache is
copied into the least recently used free slot (through the sequence's state, its used cells only, or
``llama_memory_seq_cp``, which copies its whole stream: see :meth:`LlamaCppEngine._copy_cache`; either
far cheaper than recomputing a long prefix).  So every block any slot holds can be reused, which
is what the KV router assumes.  A request whose consumer went away or stopped frees its slot before the
next admission, so a follow-up turn finds the previous turn's slot free.

KV events (slot_blocks.py) and load metrics.  Once :meth:`LlamaCppEngine.attach` connects publishers (a
worker, ``in=dyn://``), the scheduler names every complete block of ``kv_cache_block_size`` tokens that a
slot computes with the router's hashes and reports ``stored`` / ``removed`` / ``cleared`` events, handed to
the event loop once per step, and load metrics (active slots, waiting requests, cached blocks against
capacity) whenever they change, at most every 10 ms.  Each request's first item says how many of its
prompt tokens came from the cache (``EngineOutput.cached_tokens``).

Threads.  ggml synchronises its threads hundreds of times per decode step (a barrier per graph node), so
a thread count equal to the core count is fastest on a quiet machine and collapses when the cores are
shared (other work, or our own HTTP front end): one preempted thread stalls the others at every barrier
(measured on 2 shared cores: a decode step 5 to 30 times slower with 2 threads than with 1), and a
one-token step gains little from a second thread while an eight-token step gains a lot.  Unless
``n_threads`` is given, a :class:`BatchThreadTuner` picks the thread count while serving, per batch size
class: it times the steps, now and then tries another count for a few steps and keeps the faster one.
The thread count does not change the results (each output value is computed by one thread; checked
bit for bit).

Greedy requests without penalties skip llama.cpp's sampler (which copies the whole vocabulary into a
candidate array per token) and take the argmax of the logits with numpy: the same token, cheaper.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import statistics
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from dynamo.engines.llamacpp.disk_tier import DiskKvTier
from dynamo.engines.llamacpp.grammar import KINDS as GRAMMAR_KINDS
from dynamo.engines.llamacpp.grammar import gbnf_for
from dynamo.engines.llamacpp.host_tier import HostKvTier
from dynamo.errors import EngineError, ModelError, RequestError, UserError
from dynamo.kv.events import CLEARED_DATA, DEVICE, DISK, HOST
from dynamo.kv.publisher import Publisher, emit
from dynamo.kv.slot_blocks import SlotBlocks
from dynamo.kv.worker_state import WorkerKvState
from dynamo.llm.engine import Context
from dynamo.llm.first_token import Stamps, stamp
from dynamo.llm.model_card import DEFAULT_KV_CACHE_BLOCK_SIZE
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)

DEFAULT_N_PARALLEL = 8
DEFAULT_MAX_CTX_PER_SEQ = 8192
ENGINE_ARGS = {"n_parallel", "n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_gpu_layers", "flash_attn",
               "type_k", "type_v", "seed", "host_cache_mb", "disk_cache_mb", "disk_cache_dir"}
# KV offloading: a slot cache is saved to the host tier when at least this many of its tokens would be lost
OFFLOAD_MIN_TOKENS = 32
# KV cache types accepted for type_k / type_v (ggml_type values)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
# copy a busy slot's cache into a free slot when that saves at least this many prompt tokens of prefill
COPY_MIN_TOKENS = 16
METRICS_INTERVAL_S = 0.01  # load metrics are pushed at most this often
# a step of at least this many tokens is prompt work (matrix-matrix): it gains from every idle core
PREFILL_TOKENS = 16
# a probe of fewer threads for prompt-sized steps ends at its first step this much slower than the
# current count (one thread takes 1.6 to 1.8x as long for a 30-token prompt on 2 idle cores; such a probe
# cannot win, and each of its steps is a request's time to first token)
PREFILL_ABORT = 1.25
HIT_RATE_WINDOW = 1000  # requests in the prefix-cache hit rate


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
    grammar: str | None = None  # GBNF from guided decoding (llamacpp_grammar.py)
    cached_tokens: int = 0  # prompt tokens reused from the cache (set on admission)
    state_io: Any = None  # disaggregation (disagg/worker.py StateIO): export or import the sequence state
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens: the whole prompt is computed
    stamps: Stamps | None = None  # time-to-first-token stamps (first_token.py; -v only)


@dataclass
class _Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence
    req: _Request | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    last: int = -1  # the token to feed next in decode
    generated: int = 0
    sampler: Any = None
    greedy: bool = False  # plain argmax: no llama.cpp sampler needed
    prompt_lp: list[Any] | None = None  # the prompt's logprobs so far (requests that asked for them)
    used_at: float = 0.0


class ThreadTuner:
    """Picks the llama.cpp thread count on a machine whose cores are shared, by measuring.

    The scheduler asks :meth:`threads` before each step and reports each pure decode step's time with
    :meth:`record`.  It starts with the fewest threads (the safe choice on a busy machine) and keeps the
    per-token time of the last ``window`` steps at the current count; every ``gap`` seconds it runs
    ``probe_steps`` steps at another count (the next candidate in turn), and switches when their median
    is at least ``margin`` faster.  A probe step slower than ``abort`` times the current median ends the
    probe at once (more threads than free cores can be many times slower).  A failed probe doubles the
    gap up to ``max_gap``; a switch resets it.  If the current count gets ``degrade`` times slower than
    it was when chosen (the machine got busier), it probes again after ``min_gap`` seconds.

    ``idle()`` (optional) returns how many cores the machine left idle recently; a probe with more
    threads is skipped (and looked at again after ``min_gap``) unless ``idle_per_thread`` idle cores per
    extra thread are there: on a saturated machine such probes often cost a slow step.  Not always, so
    the ``force_after``-th skip in a row probes anyway (a failed one still doubles the gap): when other
    processes keep the cores busy, each of our threads gets its share of them: llama-server's two
    threads made 11.3 ms per token where our one made 31 ms, minutes apart at load average 5 to 6
    (docs/performance.md), while at load average 10, beside multi-threaded jobs, two threads were 18x
    slower than one.  Only a measurement tells which case this is.  Per-token costs are compared only between
    steps of similar size (see :class:`BatchThreadTuner`).

    ``free()`` (optional; prompt-sized steps) returns how many cores other processes left us recently (idle
    ones plus those this process used); a probe with *fewer* threads is skipped while that is at least the
    current count less half a core: with a core for each thread a prompt step is faster with more threads,
    and every step of such a probe is a prompt computed more slowly, i.e. a request's time to first token.
    """

    def __init__(self, candidates: list[int], *, start: int | None = None, window: int = 8, probe_steps: int = 4,
                 margin: float = 0.9, abort: float = 2.0, degrade: float = 1.6, min_gap: float = 1.0,
                 max_gap: float = 30.0, idle: Any = None, idle_per_thread: float = 0.25, force_after: int = 4,
                 free: Any = None, clock: Any = time.monotonic):
        self.candidates = sorted(set(candidates))
        self.current = start if start is not None else self.candidates[0]
        self.window, self.probe_steps, self.margin, self.abort = window, probe_steps, margin, abort
        self.degrade, self.min_gap, self.max_gap = degrade, min_gap, max_gap
        self.idle, self.idle_per_thread, self.force_after = idle, idle_per_thread, force_after
        self.free = free
        self.skipped = 0
        self._skips_in_row = 0
        self.clock = clock
        self.recent: deque[float] = deque(maxlen=window)
        self.baseline: float | None = None
        self.gap = min_gap
        self.next_probe = clock() + min_gap
        self.last_change = clock()
        self.probing: int | None = None
        self.probe: list[float] = []
        self._turn = 0
        self.switches = 0

    def threads(self) -> int:
        if self.probing is not None:
            return self.probing
        others = [c for c in self.candidates if c != self.current]
        if not others or len(self.recent) < self.window // 2:
            return self.current
        now = self.clock()
        degraded = (self.baseline is not None and now - self.last_change >= self.min_gap
                    and statistics.median(self.recent) > self.degrade * self.baseline)
        if now >= self.next_probe or degraded:
            alt = others[self._turn % len(others)]
            self._turn += 1
            if alt > self.current and self.idle is not None:
                idle = self.idle()
                if idle is not None and idle < self.idle_per_thread * (alt - self.current) \
                        and self._skips_in_row + 1 < self.force_after:
                    self.skipped += 1
                    self._skips_in_row += 1
                    self.next_probe = max(self.next_probe, now + self.min_gap)
                    self.last_change = now
                    return self.current
            if alt < self.current and self.free is not None:
                free = self.free()
                if free is not None and free >= self.current - 0.5:
                    self.skipped += 1
                    self.next_probe = max(self.next_probe, now + self.min_gap)
                    self.last_change = now
                    return self.current
            self._skips_in_row = 0
            self.probing = alt
            self.probe = []
            return self.probing
        return self.current

    def record(self, threads: int, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0:
            return
        cost = seconds / n_tokens
        if self.probing is not None and threads == self.probing:
            self.probe.append(cost)
            ref = statistics.median(self.recent)
            if cost > self.abort * ref:
                self._decide(ref, None)
            elif len(self.probe) >= self.probe_steps:
                self._decide(ref, statistics.median(self.probe))
        elif threads == self.current:
            self.recent.append(cost)
            if self.baseline is None and len(self.recent) == self.window:
                self.baseline = statistics.median(self.recent)

    def _decide(self, ref: float, probed: float | None) -> None:
        now = self.clock()
        alt, self.probing = self.probing, None
        assert alt is not None  # only called while probing
        if probed is not None and probed < self.margin * ref:
            log.debug("llama.cpp threads %d -> %d (%.2f -> %.2f ms per token)", self.current, alt, ref * 1e3,
                      probed * 1e3)
            self.current = alt
            self.recent = deque(self.probe, maxlen=self.window)
            self.baseline = probed
            self.gap = self.min_gap
            self.switches += 1
        else:
            self.gap = min(self.gap * 2, self.max_gap)
            self.baseline = ref
        self.last_change = now
        self.next_probe = now + self.gap


class BatchThreadTuner:
    """One :class:`ThreadTuner` per batch size class (1, 2-3, 4-7, 8-15, ...).

    The best thread count depends on the batch: one token per step gains little from a second thread
    (the step is short and every barrier costs), eight tokens gain a lot.  A single tuner would see the
    per-token time jump whenever streams start or finish and chase the batch size instead of the machine.

    A class never timed follows the nearest smaller class that was, except a prompt-sized class
    (``PREFILL_TOKENS`` or more): when it first appears while the machine has the cores (``free``, the
    cores other processes leave us, at least the most threads less half a core; without ``free``, idle
    cores as the probes' test), it starts with the most threads.  Following a one-token class there would
    keep prompts on one thread because a second one does not speed up a single token much, though it
    does speed up a prompt (1.6 to 1.8x for 30 tokens on 2 idle cores); prompts are rare steps, so their
    class would take minutes to tune itself from one thread, and every time-to-first-token would pay for
    it meanwhile.  For the same reason a prompt-sized class probes fewer threads only when other
    processes take cores (``free``, see :class:`ThreadTuner`), and such a probe ends at its first step
    ``PREFILL_ABORT`` times slower: before, a prompt class re-probed one thread for four steps soon after
    it started, which at one stream is four requests in a row with a 1.6 to 1.8x slower prefill
    (docs/performance.md).

    With ``free``, every class starts that way, decode ones included: on a quiet machine two threads
    decode one token 1.5x faster here (7.6 against 11.6 ms), and a first class started at one thread
    ran about the first second of a server's life on it (until a probe, after 1 s and four steps), e.g.
    the first 60 tokens of ``llamacpp_compare.py``'s one-stream level.  Where other processes take the
    cores it starts with the fewest, as before.
    """

    def __init__(self, candidates: list[int], *, free: Any = None, **kw: Any):
        self.candidates = sorted(set(candidates))
        self._free = free
        self._kw = kw
        self.tuners: dict[int, ThreadTuner] = {}
        self._wide_start: set[int] = set()  # classes that started with the most threads

    @staticmethod
    def bucket(n_tokens: int) -> int:
        return 1 << min(max(n_tokens, 1).bit_length() - 1, 6)

    def tuner(self, n_tokens: int) -> ThreadTuner:
        b = self.bucket(n_tokens)
        t = self.tuners.get(b)
        if t is None:
            kw = self._kw
            if b >= PREFILL_TOKENS:
                kw = {**kw, "free": self._free, "abort": min(kw.get("abort", PREFILL_ABORT), PREFILL_ABORT)}
            t = self.tuners[b] = ThreadTuner(self.candidates, **kw)
        return t

    def threads(self, n_tokens: int) -> int:
        b = self.bucket(n_tokens)
        if b not in self.tuners and (b >= PREFILL_TOKENS or self._free is not None) and self._cores_idle():
            self.tuner(n_tokens).current = self.candidates[-1]
            self._wide_start.add(b)
        t = self.tuner(n_tokens)
        if t.probing is None and len(t.recent) < t.window // 2 and b not in self._wide_start:
            # too few steps of this size timed yet (big prefill batches are rare): follow the choice of
            # the nearest smaller size class that has been timed
            known = [c for c, u in self.tuners.items() if c < b and len(u.recent) >= u.window // 2]
            if known and self.tuners[max(known)].current != t.current:
                t.current = self.tuners[max(known)].current
                t.recent.clear()
                t.baseline = None
        return t.threads()

    def record(self, threads: int, n_tokens: int, seconds: float) -> None:
        self.tuner(n_tokens).record(threads, n_tokens, seconds)

    def _cores_idle(self) -> bool:
        """Enough cores for the most threads: left to us by other processes (``free``, when given: our own
        decode threads may be what keeps them busy), else idle as a probe needs; unknown counts as yes."""
        if self._free is not None:
            left = self._free()
            return left is None or left >= self.candidates[-1] - 0.5
        idle = self._kw.get("idle")
        if idle is None or len(self.candidates) < 2:
            return True
        seen = idle()
        per_thread = self._kw.get("idle_per_thread", 0.25)
        return seen is None or seen >= per_thread * (self.candidates[-1] - self.candidates[0])

    @property
    def switches(self) -> int:
        return sum(t.switches for t in self.tuners.values())

    @property
    def skipped(self) -> int:
        return sum(t.skipped for t in self.tuners.values())

    def summary(self) -> str:
        return ", ".join(f"{b}+ tokens: {t.current}" for b, t in sorted(self.tuners.items()))


_QUIET_LOG: Any = None  # module-level on purpose: llama.cpp keeps calling it after an engine is gone


def silence_llama_log(L: Any) -> None:
    """Send llama.cpp's log nowhere.  The ctypes callback must outlive every engine: llama.cpp keeps the
    pointer, and a callback freed with its engine crashed the next model load in the same process."""
    global _QUIET_LOG
    if _QUIET_LOG is None:
        _QUIET_LOG = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))


class LlamaCppEngine:
    kind = "core"
    guided_decoding = GRAMMAR_KINDS  # json schemas, choices and GBNF through llama.cpp grammars
    logit_bias = True  # llama.cpp's logit-bias sampler
    # logprobs: a log-softmax of the logits each token was sampled from, i.e. the model's raw distribution
    # (before logit_bias, grammar, penalties and temperature), as vLLM reports by default
    logprobs = True
    prompt_logprobs = True  # computed by evaluating the whole prompt (no prefix-cache reuse for them)
    # generate() takes state_io (disagg/worker.py): the prefill worker exports a sequence's KV state
    # after the prompt (llama_state_seq_get_data), the decode worker loads it into a slot (set_data)
    supports_state_io = True

    @property
    def capacity(self) -> int:
        """Sequences decoded at once (n_parallel): a worker's default --max-inflight."""
        return self.n_parallel

    def __init__(self, gguf_path: Path, *, context_length: int, args: dict[str, Any] | None = None,
                 verbose: bool = False, block_size: int = DEFAULT_KV_CACHE_BLOCK_SIZE):
        args = dict(args or {})
        unknown = set(args) - ENGINE_ARGS
        if unknown:
            raise UserError(f"--extra-engine-args: unknown llamacpp argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(ENGINE_ARGS)}")
        self.path = gguf_path
        self.n_parallel = int(args.get("n_parallel", DEFAULT_N_PARALLEL))
        self.n_ctx_seq = context_length
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.cores = cores
        # n_threads absent: tuned while serving (see ThreadTuner); given: fixed
        self.n_threads: int | None = int(args["n_threads"]) if "n_threads" in args else None
        self.n_threads_batch: int | None = int(args["n_threads_batch"]) if "n_threads_batch" in args else None
        self.n_batch = int(args.get("n_batch", 512))
        self.n_ubatch = int(args.get("n_ubatch", min(self.n_batch, 512)))
        self.n_gpu_layers = int(args.get("n_gpu_layers", 0))
        self.flash_attn = args.get("flash_attn")
        self.type_k = _kv_type(args.get("type_k"), "type_k")
        self.type_v = _kv_type(args.get("type_v"), "type_v")
        self.seed = int(args["seed"]) if args.get("seed") is not None else None
        host_mb = float(args.get("host_cache_mb", 0) or 0)
        if host_mb < 0:
            raise UserError("--extra-engine-args: host_cache_mb must be at least 0")
        # KV offloading (kv_host_tier.py): slot caches about to be overwritten are kept in host memory,
        # and what that tier's LRU pushes out goes to disk (kv_disk_tier.py) when disk_cache_mb is given
        self.host_tier = (HostKvTier(int(host_mb * (1 << 20)), block_size, spill=self._spill)
                          if host_mb > 0 else None)
        disk_mb = float(args.get("disk_cache_mb", 0) or 0)
        if disk_mb < 0:
            raise UserError("--extra-engine-args: disk_cache_mb must be at least 0")
        if disk_mb and self.host_tier is None:
            raise UserError("--extra-engine-args: disk_cache_mb needs host_cache_mb (the disk tier takes what "
                            "the host-memory tier evicts)")
        if args.get("disk_cache_dir") and not disk_mb:
            raise UserError("--extra-engine-args: disk_cache_dir is given but disk_cache_mb is not")
        self._disk_args = (Path(args.get("disk_cache_dir") or Path(tempfile.gettempdir()) / "dynamo-kv-cache"),
                           int(disk_mb * (1 << 20))) if disk_mb else None
        self.disk_tier: DiskKvTier | None = None  # made by _load
        if self.n_parallel < 1 or self.n_batch < 1 or self.n_ubatch < 1:
            raise UserError("--extra-engine-args: n_parallel, n_batch and n_ubatch must be at least 1")
        self.verbose = verbose
        self._waiting: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._model = self._lctx = self._vocab = self._mem = None
        self._slots: list[_Slot] = []
        self.tuner: BatchThreadTuner | None = None
        self._threads_set = (0, 0)
        self.steps = 0
        self.decoded_tokens = 0
        self.reused_tokens = 0
        # since the last stats line: steps, tokens, seconds in llama_decode, seconds between back-to-back steps
        self._stats: list[Any] = [0, 0, 0.0, 0.0, 0]
        self._stats_at = time.perf_counter()
        self._last_end = 0.0
        # KV events and load metrics (attach); the scheduler thread tracks, the event loop publishes
        self.block_size = block_size
        self.slot_blocks = SlotBlocks(block_size)
        self.kv_state = WorkerKvState()
        self.worker_id = 0
        self.publish_metrics: Publisher | None = None
        self._tracking = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hits: deque[float] = deque(maxlen=HIT_RATE_WINDOW)
        self._metrics_key: tuple[int, int, int] | None = None
        self._metrics_sent_at = 0.0
        self._metrics_timer: asyncio.TimerHandle | None = None
        self.copies = 0
        self.state_copies = 0  # copies made through the sequence state (_copy_cache)
        # a donor holding at most this many tokens is copied through its state, a longer one with seq_cp
        self.state_copy_max_tokens = self.n_ctx_seq // 4

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="llamacpp-scheduler", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import llama_cpp as L
        import numpy as np

        self._L = L
        self._np = np
        if self._disk_args is not None:
            root, max_bytes = self._disk_args
            try:
                self.disk_tier = DiskKvTier(root, max_bytes, self.block_size)
            except OSError as e:
                raise UserError(f"--extra-engine-args: disk_cache_dir {root}: {e}") from None
        if not self.verbose:
            silence_llama_log(L)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = self.n_gpu_layers
        model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise ModelError(f"llama.cpp cannot load {self.path}: corrupt file or unsupported architecture "
                             "(run with -v to see llama.cpp's log)")
        if self.n_threads is None and self.n_gpu_layers == 0 and self.cores > 1:
            cands = [1, self.cores] if self.cores <= 4 else [self.cores // 2, self.cores]
            self.tuner = BatchThreadTuner(cands, idle=_IdleCores(), free=_CoresLeftToUs())
            threads = self.tuner.candidates[0]
        else:
            threads = self.n_threads or self.cores
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.n_ctx_seq * self.n_parallel
        cparams.n_seq_max = self.n_parallel
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(self.n_ubatch, self.n_batch)
        cparams.n_threads = threads
        cparams.n_threads_batch = self.n_threads_batch or threads
        cparams.kv_unified = False  # each sequence has its own n_ctx_seq tokens of cache
        cparams.no_perf = True
        if self.type_k is not None:
            cparams.type_k = self.type_k
        if self.type_v is not None:
            cparams.type_v = self.type_v
        if self.flash_attn is not None:
            cparams.flash_attn_type = 1 if self.flash_attn else 0
        lctx = L.llama_init_from_model(model, cparams)
        if not lctx:
            L.llama_model_free(model)
            raise ModelError(f"llama.cpp cannot create a context of {cparams.n_ctx} tokens for {self.path} "
                             "(out of memory? lower --context-length or n_parallel)")
        self._model, self._lctx = model, lctx
        self._threads_set = (cparams.n_threads, cparams.n_threads_batch)
        self._vocab = L.llama_model_get_vocab(model)
        self._mem = L.llama_get_memory(lctx)
        self._n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self._batch = L.llama_batch_init(max(self.n_batch, self.n_parallel), 0, 1)
        self._slots = [_Slot(seq_id=i) for i in range(self.n_parallel)]
        log.info("llama.cpp loaded %s: %d parallel sequences of %d tokens, %s threads",
                 self.path.name, self.n_parallel, self.n_ctx_seq,
                 f"{'/'.join(map(str, self.tuner.candidates))} (tuned)" if self.tuner else threads)

    async def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            if self._thread.is_alive():  # stuck in llama.cpp: freeing under it would crash
                log.warning("llama.cpp scheduler did not stop; leaving the model to the process exit")
                return
        if self._lctx is not None:
            L = self._L
            for slot in self._slots:
                if slot.sampler is not None:
                    L.llama_sampler_free(slot.sampler)
                    slot.sampler = None
            L.llama_batch_free(self._batch)
            L.llama_free(self._lctx)
            L.llama_model_free(self._model)
            self._lctx = self._model = None
        if self.disk_tier is not None:
            self.disk_tier.close()
        log.debug("llama.cpp engine closed: %d steps, %d tokens decoded, %d prompt tokens reused, "
                  "thread switches %s (probes skipped %s), threads now %s", self.steps,
                  self.decoded_tokens, self.reused_tokens, self.tuner.switches if self.tuner else "-",
                  self.tuner.skipped if self.tuner else "-", self.tuner.summary() if self.tuner else "-")

    # -- KV events and load metrics (a worker wires these) --------------------------------------
    def attach(self, worker_id: int, *, publish_kv_event: Publisher | None = None,
               publish_metrics: Publisher | None = None) -> None:
        """Publish KV events and load metrics as ``worker_id`` (call on the event loop, before serving).

        Starts with ``cleared``: whatever a router believed about this worker id is void."""
        self._loop = asyncio.get_running_loop()
        self.worker_id = worker_id
        self.kv_state.worker_id = worker_id
        self.kv_state.publish = publish_kv_event
        self.publish_metrics = publish_metrics
        with self._cv:
            self.slot_blocks = SlotBlocks(self.block_size)
            for slot in self._slots:  # anything cached before now is named from scratch
                self.slot_blocks.extend(slot.seq_id, slot.cached)
            self._tracking = True
            events = [(DEVICE, CLEARED_DATA), *((DEVICE, d) for d in self.slot_blocks.take_events())]
            for tier, store in ((HOST, self.host_tier), (DISK, self.disk_tier)):
                if store is not None:
                    events += [(tier, d) for d in store.names.rename_all(store.keys())]
        for tier, data in events:
            self.kv_state.send(data, tier)
        self._metrics_changed()

    @property
    def publishes_kv_events(self) -> bool:
        return True

    def kv_state_dump(self) -> dict[str, Any]:
        """Every cached block, as the events so far describe it (the ``kv_state`` query)."""
        return self.kv_state.dump()

    @property
    def runtime_config(self) -> dict[str, Any]:
        return {"total_kv_blocks": self._total_blocks(), "max_num_seqs": self.n_parallel,
                "max_num_batched_tokens": self.n_batch, "kv_cache_block_size": self.block_size}

    def _total_blocks(self) -> int:
        return self.n_parallel * (self.n_ctx_seq // self.block_size)

    def load_metrics(self, dp_rank: int = 0) -> dict[str, Any]:
        """ForwardPassMetrics, as the mocker's: busy slots, waiting requests, cached blocks / capacity."""
        total = max(1, self._total_blocks())
        cached = self.slot_blocks.cached_blocks if self._tracking else sum(
            len(s.cached) // self.block_size for s in self._slots)
        hits = list(self._hits)
        return {
            "worker_stats": {"data_parallel_rank": 0,
                             "request_active_slots": sum(1 for s in self._slots if s.req is not None),
                             "request_total_slots": self.n_parallel, "num_requests_waiting": len(self._waiting)},
            "kv_stats": {"kv_active_blocks": cached, "kv_total_blocks": total,
                         "gpu_cache_usage_perc": min(1.0, cached / total),
                         "gpu_prefix_cache_hit_rate": sum(hits) / len(hits) if hits else 0.0},
            "spec_decode_stats": None,
        }

    def all_load_metrics(self) -> list[dict[str, Any]]:
        return [self.load_metrics()]

    def _metrics_changed(self) -> None:
        """On the loop: push the load metrics if they changed, at most every METRICS_INTERVAL_S."""
        if self.publish_metrics is None or self._metrics_timer is not None or self._loop is None:
            return
        key = (sum(1 for s in self._slots if s.req is not None), len(self._waiting),
               self.slot_blocks.cached_blocks)
        if key == self._metrics_key:
            return
        wait = self._metrics_sent_at + METRICS_INTERVAL_S - self._loop.time()
        if wait > 0:
            self._metrics_timer = self._loop.call_later(wait, self._metrics_due)
            return
        self._metrics_key = key
        self._metrics_sent_at = self._loop.time()
        emit(self.publish_metrics, {"worker_id": self.worker_id, "data": self.load_metrics()}, "load metrics")

    def _metrics_due(self) -> None:
        self._metrics_timer = None
        self._metrics_changed()

    def _on_kv_changes(self, events: list[tuple[str, Any]]) -> None:
        """On the loop, in step order: publish one step's KV events (tier, data), then the metrics if they
        moved."""
        for tier, data in events:
            self.kv_state.send(data, tier)
        self._metrics_changed()

    def _flush_kv_changes(self) -> None:
        """In the scheduler thread, after admitting or a step: hand the changes to the loop."""
        lower = [(tier, d) for tier, store in ((HOST, self.host_tier), (DISK, self.disk_tier)) if store is not None
                 for d in store.names.take_events()]  # taken even when nobody listens: they would pile up
        if not self._tracking or self._loop is None:
            return
        events = [(DEVICE, d) for d in self.slot_blocks.take_events()] + lower
        key = (sum(1 for s in self._slots if s.req is not None), len(self._waiting), self.slot_blocks.cached_blocks)
        if not events and key == self._metrics_key:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_kv_changes, events)
        except RuntimeError:  # the loop is closed
            pass

    # -- the asyncio side ---------------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest, context: Context,
                       state_io: Any = None) -> AsyncIterator[EngineOutput]:
        if self._thread is None:
            raise EngineError("llamacpp engine is not started")
        sc = request.stop_conditions
        prompt = list(request.token_ids)
        if not prompt:
            raise EngineError("empty prompt: nothing to decode")
        room = self.n_ctx_seq - len(prompt)
        if room <= 0:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {self.n_ctx_seq}")
        max_tokens = min(sc.max_tokens or room, room)
        eos = frozenset(request.eos_token_ids or ()) | frozenset(sc.stop_token_ids_hidden or ())
        if sc.ignore_eos:
            eos = frozenset(sc.stop_token_ids_hidden or ())
        loop = asyncio.get_running_loop()
        oo = request.output_options
        req = _Request(prompt, max_tokens, eos, request.sampling_options, context, asyncio.Queue(), loop,
                       grammar=self._grammar(request.sampling_options.guided_decoding), state_io=state_io,
                       logprobs=oo.logprobs, prompt_logprobs=oo.prompt_logprobs, stamps=context.stamps)
        with self._cv:
            if self._closing:
                raise EngineError("llamacpp engine is shutting down")
            self._waiting.append(req)
            self._cv.notify()
        stamp(req.stamps, "queued")
        self._metrics_changed()
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, EngineOutput):
                    if req.stamps is not None:
                        stamp(req.stamps, "on the loop")
                        req.stamps = None
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
                    self._reap()
                    self._admit()
                self._step()
                self._flush_kv_changes()
        except Exception as e:  # never leave requests hanging if llama.cpp fails
            log.exception("llama.cpp scheduler failed")
            self._fail_active(f"llama.cpp failed: {e}")
        finally:
            self._fail_active("llamacpp engine is shutting down")
            self._fail_waiting("llamacpp engine is shutting down")

    def _fail_active(self, why: str) -> None:
        items = []
        for slot in self._slots:
            if slot.req is not None:
                items.append((slot.req, why))
                self._finish(slot)
        self._deliver(items)

    def _fail_waiting(self, why: str) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        self._deliver([(r, why) for r in waiting])

    def _reap(self) -> None:
        """Free the slots of requests whose consumer went away or asked to stop (a finished turn whose
        stream the post-processor ended), so that the next request can use their caches."""
        dropped = []
        for slot in self._slots:
            req = slot.req
            if req is not None and (req.cancelled or req.ctx.is_stopped):
                dropped.append((req, EngineOutput(finish_reason="cancelled")))
                self._finish(slot)
        self._deliver(dropped)

    def _admit(self) -> None:
        """Move waiting requests into free slots, each to the slot sharing the longest prompt prefix
        (copied from a busy slot when that one shares clearly more).  A request whose prefix a busy slot
        is still computing waits for it instead of computing it a second time beside it."""
        deferred: list[_Request] = []
        try:
            self._admit_some(deferred)
        finally:
            self._waiting.extendleft(reversed(deferred))

    def _admit_some(self, deferred: list[_Request]) -> None:
        while self._waiting:
            free = [s for s in self._slots if s.req is None]
            if not free:
                return
            req = self._waiting.popleft()
            stamp(req.stamps, "taken")
            if req.cancelled or req.ctx.is_stopped:
                self._deliver([(req, EngineOutput(finish_reason="cancelled"))])
                continue
            if (req.state_io is not None and req.state_io.state is not None and req.logprobs is None
                    and self._admit_imported(req, free)):  # (logprobs: the first token's needs the logits)
                continue
            if req.prompt_logprobs is not None:
                self._admit_whole_prompt(req, free)
                continue
            last = len(req.prompt) - 1
            prefix = {s.seq_id: _common_prefix(s.cached, req.prompt) for s in self._slots}
            best = max(free, key=lambda s: (prefix[s.seq_id], -s.used_at))
            if 2 * prefix[best.seq_id] < len(best.cached):
                # this prompt would reuse less of that slot's cache than it overwrites (a shared system
                # prompt, then another conversation): an empty slot keeps that conversation restorable
                empty = [s for s in free if not s.cached]
                if empty:
                    best = min(empty, key=lambda s: s.used_at)
            keep = min(prefix[best.seq_id], last)
            busy = [s for s in self._slots if s.req is not None]
            # any other slot, busy or free, whose cache holds more of this prompt can lend it
            donor = max((s for s in self._slots if s is not best), key=lambda s: prefix[s.seq_id], default=None)
            now = max(keep, min(prefix[donor.seq_id], last) if donor is not None else 0)
            later = max((min(_common_prefix(s.req.prompt, req.prompt), last)  # type: ignore[union-attr]
                         for s in busy if s.pending), default=0)
            if later >= now + COPY_MIN_TOKENS:
                deferred.append(req)  # admitted (with a copy) once that slot's prefill is done
                continue
            L = self._L
            if donor is not None and min(prefix[donor.seq_id], last) >= keep + COPY_MIN_TOKENS:
                # another slot holds much more of this prompt: copy its cache over the least recently used
                # free slot (the copy runs at the start of the next llama_decode)
                targets = [s for s in free if s is not donor]
                best = min([s for s in targets if not s.cached] or targets, key=lambda s: s.used_at)
                keep = min(prefix[donor.seq_id], last)
                self._offload(best, 0)
                t0 = time.perf_counter()
                how = self._copy_cache(donor, best)
                self.copies += 1
                if self._tracking:
                    self.slot_blocks.copy(donor.seq_id, best.seq_id, keep)
                log.debug("request %s: slot %d copies %d cached tokens from slot %d (%s of %d tokens, %.1f ms)",
                          req.ctx.id, best.seq_id, keep, donor.seq_id, how, len(donor.cached),
                          1e3 * (time.perf_counter() - t0))
                best.cached = donor.cached[:keep]
            else:
                self._offload(best, keep)
            keep = self._restore(best, req.prompt, keep)
            if not L.llama_memory_seq_rm(self._mem, best.seq_id, keep, -1):
                L.llama_memory_seq_rm(self._mem, best.seq_id, -1, -1)
                keep = 0
            if self._tracking:
                self.slot_blocks.truncate(best.seq_id, keep)
            best.cached = req.prompt[:keep]
            req.cached_tokens = keep
            self._hits.append(keep / len(req.prompt))
            best.pending = req.prompt[keep:]
            self._start_request(best, req)
            self.reused_tokens += keep
            log.debug("request %s: slot %d, %d prompt tokens, %d reused from the cache", req.ctx.id,
                      best.seq_id, len(req.prompt), keep)
            stamp(req.stamps, "admitted", f"slot {best.seq_id}, {keep} of {len(req.prompt)} tokens cached")

    def _copy_cache(self, donor: _Slot, dst: _Slot) -> str:
        """Make ``dst``'s sequence a copy of ``donor``'s (the caller truncates it to the shared prefix).

        With a cache stream per sequence, ``llama_memory_seq_cp`` copies the donor's whole stream,
        ``n_ctx_seq`` cells whatever it holds (about 30 ms for SmolLM2's 8,192 cells here: a quarter of a
        short prompt's prefill, docs/performance.md).  The sequence's state holds only its used cells, so while
        the donor holds less than a quarter of its stream (an export and an import: two passes over them
        and the buffer) that is the cheaper copy: 2 ms for 180 tokens.  seq_cp otherwise, and if
        llama.cpp refuses the state."""
        L = self._L
        L.llama_memory_seq_rm(self._mem, dst.seq_id, -1, -1)
        if len(donor.cached) <= self.state_copy_max_tokens:
            np = self._np
            size = L.llama_state_seq_get_size(self._lctx, donor.seq_id)
            buf = np.empty(size, dtype=np.uint8)  # (not zero-filled, unlike a ctypes array)
            ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            if (L.llama_state_seq_get_data(self._lctx, ptr, size, donor.seq_id) == size
                    and L.llama_state_seq_set_data(self._lctx, ptr, size, dst.seq_id) == size
                    and L.llama_memory_seq_pos_max(self._mem, dst.seq_id) == len(donor.cached) - 1):
                self.state_copies += 1
                return "sequence state"
            L.llama_memory_seq_rm(self._mem, dst.seq_id, -1, -1)
            log.warning("copying slot %d's cache through its state failed; copying its stream", donor.seq_id)
        # (the copy runs at the start of the next llama_decode)
        L.llama_memory_seq_cp(self._mem, donor.seq_id, dst.seq_id, -1, -1)
        return "whole stream"

    def _admit_whole_prompt(self, req: _Request, free: list[_Slot]) -> None:
        """A request for the prompt's logprobs needs the logits at every prompt position, so nothing of
        it comes from a cache: it takes the least recently used free slot and computes it all."""
        best = min(free, key=lambda s: s.used_at)
        self._offload(best, 0)
        self._L.llama_memory_seq_rm(self._mem, best.seq_id, -1, -1)
        if self._tracking:
            self.slot_blocks.truncate(best.seq_id, 0)
        best.cached = []
        req.cached_tokens = 0
        self._hits.append(0.0)
        best.pending = list(req.prompt)
        self._start_request(best, req)
        best.prompt_lp = [None]  # the first prompt token has no logprob (nothing precedes it)

    def _start_request(self, slot: _Slot, req: _Request) -> None:
        slot.req = req
        slot.generated = 0
        slot.prompt_lp = None
        if slot.sampler is not None:
            self._L.llama_sampler_free(slot.sampler)
            slot.sampler = None
        slot.greedy = _is_greedy(req.sampling) and req.grammar is None and not req.sampling.logit_bias
        if not slot.greedy:
            slot.sampler = self._make_sampler(req.sampling, req.grammar)

    def _admit_imported(self, req: _Request, free: list[_Slot]) -> bool:
        """Load a prefill worker's state of ``req.prompt`` into the least recently used free slot and
        answer its first token; False (nothing changed, prefill locally) if llama.cpp refuses the state."""
        io = req.state_io
        data, io.state = io.state, None  # the bytes are not needed after this
        L = self._L
        slot = min(free, key=lambda s: s.used_at)
        L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        t0 = time.perf_counter()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        n = L.llama_state_seq_set_data(self._lctx, buf, len(data), slot.seq_id)
        ok = n == len(data) and L.llama_memory_seq_pos_max(self._mem, slot.seq_id) == len(req.prompt) - 1
        if self._tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)
        if not ok:
            L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            slot.cached = []
            log.warning("request %s: llama.cpp refused the transferred KV state (%d of %d bytes read); "
                        "prefilling locally", req.ctx.id, n, len(data))
            return False
        io.imported = True
        slot.cached = list(req.prompt)
        slot.pending = []
        if self._tracking:
            self.slot_blocks.extend(slot.seq_id, slot.cached)
        self._start_request(slot, req)
        self._hits.append(0.0)
        log.debug("request %s: slot %d loaded the KV state of %d prompt tokens (%d bytes) in %.1f ms", req.ctx.id,
                  slot.seq_id, len(req.prompt), len(data), 1e3 * (time.perf_counter() - t0))
        # the prefill worker's token is this sequence's first: answer it and decode from it
        tok = int(io.first_token)
        slot.generated = 1
        slot.last = tok
        reason = "eos" if tok in req.eos else ("length" if req.max_tokens <= 1 else None)
        self._deliver([(req, EngineOutput(token_ids=[tok], finish_reason=reason, cached_tokens=0))])
        if reason is not None:
            self._finish(slot)
        return True

    def _offload(self, slot: _Slot, keep: int) -> None:
        """Save ``slot``'s cache to the host tier if more than OFFLOAD_MIN_TOKENS of it are about to go."""
        tier = self.host_tier
        if tier is None or len(slot.cached) - keep < OFFLOAD_MIN_TOKENS:
            return
        try:
            tier.put(list(slot.cached), self._export_state(slot))
        except EngineError as e:
            log.warning("KV offload of slot %d failed: %s", slot.seq_id, e)

    def _spill(self, key: tuple[int, ...], data: bytes) -> None:
        """The host tier's LRU pushed an entry out: keep it on disk if there is a disk tier."""
        if self.disk_tier is not None:
            self.disk_tier.put(key, data)

    def _restore(self, slot: _Slot, prompt: list[int], keep: int) -> int:
        """Load the best host or disk entry for ``prompt`` into ``slot`` if it saves OFFLOAD_MIN_TOKENS of
        prefill over ``keep``; returns the tokens now reusable (the caller truncates to it).  An entry read
        from disk moves back to host memory; a damaged one is dropped and the prompt computed."""
        host, disk = self.host_tier, self.disk_tier
        if host is None:
            return keep
        found = host.best(prompt) if len(host) else None
        source: HostKvTier | DiskKvTier = host
        if disk is not None and len(disk):
            on_disk = disk.best(prompt)
            if on_disk is not None and (found is None or on_disk[1] > found[1]):
                found, source = on_disk, disk
        if found is None:
            return keep
        key, n = found
        n = min(n, len(prompt) - 1)
        if n < keep + OFFLOAD_MIN_TOKENS:
            return keep
        data = source.get(key)
        if data is None:  # a damaged file (logged, removed): compute the prompt
            return keep
        if source is disk and len(data) <= host.max_bytes:  # back to host memory (it never fits: stays on disk)
            disk.remove(key)
            host.put(key, data)
        tier = source
        L = self._L
        L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = (L.llama_state_seq_set_data(self._lctx, buf, len(data), slot.seq_id) == len(data)
              and L.llama_memory_seq_pos_max(self._mem, slot.seq_id) == len(key) - 1)
        if self._tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)
        if not ok:
            L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            slot.cached = []
            log.warning("KV restore into slot %d failed; computing the prompt", slot.seq_id)
            return 0
        slot.cached = list(key)
        if self._tracking:
            self.slot_blocks.extend(slot.seq_id, slot.cached)
        tier.restored += 1
        log.debug("slot %d: restored %d cached tokens from the %s tier", slot.seq_id, n,
                  "disk" if tier is disk else "host")
        return n

    def _export_state(self, slot: _Slot) -> bytes:
        """The slot's sequence state (its KV cache of the prompt), for a decode worker."""
        L = self._L
        t0 = time.perf_counter()
        size = L.llama_state_seq_get_size(self._lctx, slot.seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = L.llama_state_seq_get_data(self._lctx, buf, size, slot.seq_id)
        if n != size:
            raise EngineError(f"llama.cpp exported {n} of {size} bytes of sequence state")
        data = bytes(buf)
        log.debug("slot %d: exported the KV state of %d tokens (%d bytes) in %.1f ms", slot.seq_id, len(slot.cached),
                  size, 1e3 * (time.perf_counter() - t0))
        return data

    def _grammar(self, guided: dict[str, Any] | None) -> str | None:
        """The request's grammar, checked by llama.cpp's parser now (a bad one is the client's 400)."""
        grammar = gbnf_for(guided)
        if grammar is not None:
            L = self._L
            probe = L.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
            if not probe:
                raise RequestError("llama.cpp cannot parse this grammar", param="guided_grammar")
            L.llama_sampler_free(probe)
        return grammar

    def _make_sampler(self, so: Any, grammar: str | None = None) -> Any:
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if so.logit_bias:
            biases = (L.llama_logit_bias * len(so.logit_bias))(
                *(L.llama_logit_bias(int(k), float(v)) for k, v in so.logit_bias.items()))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(self._n_vocab, len(biases), biases))
        if grammar is not None:  # the samplers after it only see tokens the grammar allows
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root"))
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
        seed = so.seed if so.seed is not None else self.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
        return chain

    def _finish(self, slot: _Slot) -> None:
        slot.req = None
        slot.pending = []
        slot.used_at = time.monotonic()

    def _set_threads(self, n: int) -> None:
        want = (n, self.n_threads_batch or n)
        if want != self._threads_set:
            self._L.llama_set_n_threads(self._lctx, *want)
            self._threads_set = want

    def _step(self) -> None:
        L = self._L
        batch = self._batch
        n = 0
        outputs: list[tuple[_Slot, int]] = []  # (slot, batch index whose logits to sample)
        rows: list[int] = []  # the logits row of each output (rows are stored in batch order)
        prompt_rows: list[tuple[_Slot, int, int, int]] = []  # (slot, first row, prompt position, tokens)
        stamped: list[tuple[Stamps, int]] = []  # (stamps, prompt tokens) of stamped requests in this step
        n_rows = 0
        budget = self.n_batch
        self._reap()  # drop requests whose consumer went away or asked to stop
        # decode tokens first (one each), so running streams never wait behind a long prefill
        for slot in self._slots:
            if slot.req is not None and not slot.pending:
                _put(batch, n, slot.last, len(slot.cached), slot.seq_id, True)
                outputs.append((slot, n))
                rows.append(n_rows)
                n_rows += 1
                slot.cached.append(slot.last)
                n += 1
                budget -= 1
        for slot in self._slots:
            if slot.req is None or not slot.pending or budget <= 0:
                continue
            take = slot.pending[:budget]
            last_chunk = len(take) == len(slot.pending)
            pos = len(slot.cached)
            every = slot.prompt_lp is not None  # the prompt's logprobs: logits at every position
            for i, tok in enumerate(take):
                _put(batch, n + i, tok, pos + i, slot.seq_id, every)
            if every:
                prompt_rows.append((slot, n_rows, pos, len(take) - 1 if last_chunk else len(take)))
                n_rows += len(take)
            if last_chunk:
                batch.logits[n + len(take) - 1] = True
                outputs.append((slot, n + len(take) - 1))
                rows.append(n_rows - 1 if every else n_rows)
                n_rows += 0 if every else 1
            slot.cached.extend(take)
            n += len(take)
            slot.pending = slot.pending[len(take):]
            if slot.req.stamps is not None:
                stamped.append((slot.req.stamps, len(take)))
            budget -= len(take)
        if n == 0:
            return
        batch.n_tokens = n
        threads = self.tuner.threads(n) if self.tuner is not None else 0
        if threads:
            self._set_threads(threads)
        t0 = time.perf_counter()
        rc = L.llama_decode(self._lctx, batch)
        t1 = time.perf_counter()
        dt = t1 - t0
        self.steps += 1
        if rc != 0:
            msg = f"llama_decode failed ({rc}): out of KV cache space" if rc == 1 else f"llama_decode failed ({rc})"
            failed = {id(s) for s, _ in outputs}
            items = []
            for slot in self._slots:
                if slot.req is not None and (id(slot) in failed or rc != 1):
                    items.append((slot.req, msg))
                    L.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
                    slot.cached = []
                    if self._tracking:
                        self.slot_blocks.truncate(slot.seq_id, 0)
                    self._finish(slot)
            self._deliver(items)
            return
        if self._tracking:  # name the blocks this step completed
            for slot in self._slots:
                if slot.req is not None:
                    self.slot_blocks.extend(slot.seq_id, slot.cached)
        if threads and self.tuner is not None:
            self.tuner.record(threads, n, dt)
        for stamps, k in stamped:
            stamps.append(("prompt step", t0, f"{k} of its tokens, {n} in the step, {self._threads_set[0]} threads"))
            stamps.append(("step done", t1, ""))
        self.decoded_tokens += n
        st = self._stats
        st[0] += 1
        st[1] += n
        st[2] += dt
        if t0 - self._last_end < 0.02:  # back to back: the scheduler's own time between two decodes
            st[3] += t0 - self._last_end
            st[4] += 1
        if log.isEnabledFor(logging.DEBUG) and t0 - self._stats_at >= 10.0:
            wall = t1 - self._stats_at
            log.debug("llama.cpp: %d steps, %d tokens in %.1f s (%.1f tokens/s), %.0f%% of the time in "
                      "llama_decode, %.3f ms between back-to-back steps, threads now %s", st[0], st[1], wall,
                      st[1] / wall, 100 * st[2] / wall, 1e3 * st[3] / max(st[4], 1),
                      self.tuner.summary() if self.tuner else self._threads_set[0])
            self._stats = [0, 0, 0.0, 0.0, 0]
            self._stats_at = t1
        greedy_rows: list[int] = []
        want_lp = prompt_rows or any(slot.req.logprobs is not None for slot, _ in outputs)  # type: ignore[union-attr]
        logits = None
        if want_lp or any(slot.greedy for slot, _ in outputs):
            # logits rows are stored in batch order for the tokens that asked for them
            logits = self._np.ctypeslib.as_array(L.llama_get_logits(self._lctx), shape=(n_rows, self._n_vocab))
            if any(slot.greedy for slot, _ in outputs):
                picked = logits if n_rows == len(outputs) else logits[rows]
                greedy_rows = picked.argmax(axis=1).tolist()
        if prompt_rows:
            self._prompt_logprobs(logits, prompt_rows)
        deliveries: list[tuple[_Request, Any]] = []
        for j, (slot, idx) in enumerate(outputs):
            req = slot.req
            assert req is not None
            if slot.greedy:
                tok = greedy_rows[j]
            else:
                tok = L.llama_sampler_sample(slot.sampler, self._lctx, idx)
            slot.generated += 1
            slot.last = tok
            reason = None
            if tok in req.eos:
                reason = "eos"
            elif slot.generated >= req.max_tokens:
                reason = "length"
            out = EngineOutput(token_ids=[tok], finish_reason=reason)
            if req.logprobs is not None:
                lp, tops = _token_logprobs(self._np, logits[rows[j]], tok, req.logprobs)  # type: ignore[index]
                out.log_probs = [lp]
                out.top_logprobs = [tops]
            if slot.generated == 1:
                out.cached_tokens = req.cached_tokens
                if slot.prompt_lp is not None:
                    out.prompt_logprobs, slot.prompt_lp = slot.prompt_lp, None
                if req.state_io is not None and req.state_io.export:
                    try:
                        req.state_io.state = self._export_state(slot)
                    except EngineError as e:
                        deliveries.append((req, str(e)))
                        self._finish(slot)
                        continue
            deliveries.append((req, out))
            if reason is not None:
                self._finish(slot)
            if slot.generated == 1 and req.stamps is not None:
                stamp(req.stamps, "sampled, handed over")
        self._deliver(deliveries)
        self._last_end = time.perf_counter()

    def _prompt_logprobs(self, logits: Any, prompt_rows: list[tuple[_Slot, int, int, int]]) -> None:
        """Score each prompt token under the logits of the position before it (vectorised per chunk)."""
        np = self._np
        for slot, first, pos, count in prompt_rows:
            if count <= 0 or slot.prompt_lp is None or slot.req is None:
                continue
            x = logits[first:first + count]
            following = np.asarray(slot.req.prompt[pos + 1:pos + 1 + count])
            lse = _logsumexp(np, x)
            chosen = (x[np.arange(count), following] - lse).tolist()
            n = slot.req.prompt_logprobs or 0
            top_ids = np.argpartition(x, -n, axis=1)[:, -n:] if n > 0 else None
            for i in range(count):
                tops = []
                if top_ids is not None:
                    tops = [{"token_id": int(t), "logprob": float(x[i, t] - lse[i])} for t in top_ids[i]]
                slot.prompt_lp.append({"logprob": chosen[i], "top_logprobs": tops})

    def _deliver(self, items: list[tuple[_Request, Any]]) -> None:
        """Hand items to the requests' event loops: one ``call_soon_threadsafe`` per loop per step."""
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


class _IdleCores:
    """Idle cores of the whole machine since the previous call, from /proc/stat (None elsewhere)."""

    def __init__(self) -> None:
        self.prev = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat", "rb") as f:
                head = f.readline().split()
            ncpu = os.cpu_count() or 1
        except OSError:
            return None
        if not head or head[0] != b"cpu":
            return None
        vals = [int(x) for x in head[1:9]]
        return vals[3] + vals[4], sum(vals), ncpu

    def __call__(self) -> float | None:
        cur = self._read()
        prev, self.prev = self.prev, cur
        if cur is None or prev is None or cur[1] <= prev[1]:
            return None
        return (cur[0] - prev[0]) / (cur[1] - prev[1]) * cur[2]


class _CoresLeftToUs:
    """Cores other processes left this one since the previous call: the idle ones plus those this process
    used (from /proc/stat and ``os.times``; None elsewhere).  Unlike the idle count it does not drop when
    our own threads are what keeps the cores busy.  Calls less than ``MIN_SPAN_S`` apart get the previous
    answer (the counters tick every 10 ms)."""

    MIN_SPAN_S = 0.05

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.prev = self._read()
        self.last: float | None = None

    @staticmethod
    def _read() -> tuple[tuple[int, int, int], float] | None:
        machine = _IdleCores._read()
        if machine is None:
            return None
        t = os.times()
        return machine, t.user + t.system

    def __call__(self) -> float | None:
        cur, prev = self._read(), self.prev
        if cur is None or prev is None:
            self.prev = cur
            return None
        (idle1, total1, ncpu), ours1 = cur
        (idle0, total0, _), ours0 = prev
        span = total1 - total0  # jiffies over all cores
        if span < self.MIN_SPAN_S * self._tick * ncpu:
            return self.last
        self.prev = cur
        ours = (ours1 - ours0) * self._tick  # jiffies this process used
        self.last = min(float(ncpu), (idle1 - idle0 + ours) / span * ncpu)
        return self.last


def _put_all(group: list[tuple[_Request, Any]]) -> None:
    for req, item in group:
        req.out.put_nowait(item)


def _put(batch: Any, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq_id
    batch.logits[i] = logits


def _logsumexp(np: Any, x: Any) -> Any:
    """log(sum(exp(x))) over the last axis, stable.  In float32 (numpy sums pairwise: about 1e-6 relative
    over 49k terms); float64 exponentials cost four times as much."""
    m = x.max(axis=-1, keepdims=True)
    return (np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m).squeeze(-1)


def _token_logprobs(np: Any, row: Any, token: int, n: int) -> tuple[float, list[dict[str, Any]]]:
    """The chosen token's logprob under one logits row and the ``n`` likeliest tokens' (log-softmax in
    numpy: a few tens of microseconds over a 49k vocabulary)."""
    lse = float(_logsumexp(np, row))
    tops: list[dict[str, Any]] = []
    if n > 0:
        for t in np.argpartition(row, -n)[-n:].tolist():
            tops.append({"token_id": t, "logprob": float(row[t]) - lse})
    return float(row[token]) - lse, tops


def _is_greedy(so: Any) -> bool:
    """Temperature 0 without penalties: the next token is the argmax of the logits."""
    return (so.temperature is not None and so.temperature <= 0 and so.repetition_penalty in (None, 1.0)
            and not so.frequency_penalty and not so.presence_penalty)


def _kv_type(value: Any, name: str) -> int | None:
    if value is None:
        return None
    t = KV_TYPES.get(str(value).lower())
    if t is None:
        raise UserError(f"--extra-engine-args: {name} must be one of {sorted(KV_TYPES)}, not {value!r}")
    return t


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
