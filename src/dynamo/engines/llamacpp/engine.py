"""``out=llamacpp``: llama.cpp through llama-cpp-python's low-level API, with continuous batching.

One model, one llama context holding ``n_parallel`` sequences.  This module is the engine's asyncio face:
it reads the engine arguments, loads the model (model.py) and starts the scheduler thread
(scheduler.py) in ``start``, queues requests and streams their tokens in ``generate``, and publishes KV
events and load metrics.  The other modules each do one job:

* scheduler.py: the continuous-batching loop on its own thread (admit, build a batch, ``llama_decode``,
  sample, hand the tokens to the event loop);
* slots.py: the sequence slots and their KV caches (prefix reuse, copies between slots, offloading to and
  restoring from the host and disk tiers of host_tier.py and disk_tier.py);
* sampling.py: sampler chains, guided decoding's grammars (grammar.py), logprobs;
* threads.py: the thread count, tuned while serving;
* vision.py: images (``--mmproj``): llama.cpp's mtmd loads the projector, tokenizes each image, and the
  scheduler evaluates it in the request's slot;
* lora.py: LoRA adapters (loaded at start or at run time, by name; a request whose ``model`` names one
  runs with it, in its own batches: llama.cpp applies adapters per context);
* model.py: loading and freeing the model and its context.

KV events (slot_blocks.py) and load metrics.  Once :meth:`LlamaCppEngine.attach` connects publishers (a
worker, ``in=dyn://``), the scheduler names every complete block of ``kv_cache_block_size`` tokens that a
slot computes with the router's hashes and reports ``stored`` / ``removed`` / ``cleared`` events, handed to
the event loop once per step, and load metrics (active slots, waiting requests, cached blocks against
capacity) whenever they change, at most every 10 ms.  Each request's first item says how many of its
prompt tokens came from the cache (``EngineOutput.cached_tokens``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

from dynamo.engines.llamacpp import model, preflight
from dynamo.engines.llamacpp.grammar import KINDS as GRAMMAR_KINDS
from dynamo.engines.llamacpp.lora import Adapter, load_adapter
from dynamo.engines.llamacpp.sampling import Samplers
from dynamo.engines.llamacpp.scheduler import Scheduler
from dynamo.engines.llamacpp.slots import Request, SlotCaches
from dynamo.engines.llamacpp.threads import serving_tuner
from dynamo.engines.llamacpp.vision import Projector, expand
from dynamo.errors import EngineError, RequestError, UserError
from dynamo.kv.events import CLEARED_DATA, DEVICE
from dynamo.kv.publisher import Publisher, emit
from dynamo.kv.worker_state import WorkerKvState
from dynamo.llm.engine import Context
from dynamo.llm.first_token import stamp
from dynamo.llm.model_card import DEFAULT_KV_CACHE_BLOCK_SIZE
from dynamo.llm.model_entry import SUGGESTED_OVERLAP_WEIGHT
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)

DEFAULT_N_PARALLEL = 8
DEFAULT_MAX_CTX_PER_SEQ = 8192
ENGINE_ARGS = {"n_parallel", "n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_gpu_layers", "flash_attn",
               "type_k", "type_v", "seed", "host_cache_mb", "disk_cache_mb", "disk_cache_dir"}
# the host-memory tier's size when --extra-engine-args does not say (MiB): llama-server's default for its
# host-memory prompt cache (--cache-ram); entries are only made when a slot's cache is overwritten
DEFAULT_HOST_CACHE_MB = 8192
# the longest a request waits in line for another worker's prefix state (the fetch has its own, shorter,
# timeout: this only bounds a fetch that never reports back)
PREFIX_WAIT_LIMIT_S = 10.0
# the overlap weight these workers suggest to a KV router when all their layers run on the CPU
# (frontend/kv_policy.py; --kv-overlap-score-weight overrides it): there a block of prefill costs far more
# time than a block of a neighbour's decode load, so a conversation should stay with the worker that holds
# its history even while that worker decodes another request.  Against 2.0 on two engines behind the
# router, mean TTFT 0.85-0.97x in 6 of 6 runs, tokens/s 0.92-1.22x (docs/routing.md, "The overlap weight
# on llama.cpp")
ROUTER_OVERLAP_WEIGHT = 6.0
METRICS_INTERVAL_S = 0.01  # load metrics are pushed at most this often


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
                 verbose: bool = False, block_size: int = DEFAULT_KV_CACHE_BLOCK_SIZE, mmproj: Path | None = None):
        args = dict(args or {})
        unknown = set(args) - ENGINE_ARGS
        if unknown:
            raise UserError(f"--extra-engine-args: unknown llamacpp argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(ENGINE_ARGS)}")
        self.path = gguf_path
        self.mmproj = mmproj  # the image projector GGUF (vision.py); None: text only
        self.projector: Projector | None = None
        self.n_parallel = int(args.get("n_parallel", DEFAULT_N_PARALLEL))
        self.n_ctx_seq = context_length
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.cores = cores
        # n_threads absent: tuned while serving (threads.py); given: fixed
        self.n_threads: int | None = int(args["n_threads"]) if "n_threads" in args else None
        self.n_threads_batch: int | None = int(args["n_threads_batch"]) if "n_threads_batch" in args else None
        self.n_batch = int(args.get("n_batch", 512))
        self.n_ubatch = int(args.get("n_ubatch", min(self.n_batch, 512)))
        self.n_gpu_layers = int(args.get("n_gpu_layers", 0))
        self.flash_attn = args.get("flash_attn")
        self.type_k = model.kv_type(args.get("type_k"), "type_k")
        self.type_v = model.kv_type(args.get("type_v"), "type_v")
        self.seed = int(args["seed"]) if args.get("seed") is not None else None
        # on by default, as llama-server's host-memory prompt cache (--cache-ram, 8192 MiB); 0 turns it off
        raw_host = args.get("host_cache_mb")
        try:
            host_mb = float(DEFAULT_HOST_CACHE_MB if raw_host is None else raw_host)
        except (TypeError, ValueError):
            raise UserError(f"--extra-engine-args: host_cache_mb must be a number of MiB, not {raw_host!r}") from None
        if host_mb < 0:
            raise UserError("--extra-engine-args: host_cache_mb must be at least 0")
        # KV offloading (host_tier.py): slot caches about to be overwritten are kept in host memory,
        # and what that tier's LRU pushes out goes to disk (disk_tier.py) when disk_cache_mb is given
        self.caches = SlotCaches(self.n_ctx_seq, block_size, int(host_mb * (1 << 20)))
        disk_mb = float(args.get("disk_cache_mb", 0) or 0)
        if disk_mb < 0:
            raise UserError("--extra-engine-args: disk_cache_mb must be at least 0")
        if disk_mb and self.caches.host_tier is None:
            raise UserError("--extra-engine-args: disk_cache_mb needs host_cache_mb (the disk tier takes what "
                            "the host-memory tier evicts)")
        if args.get("disk_cache_dir") and not disk_mb:
            raise UserError("--extra-engine-args: disk_cache_dir is given but disk_cache_mb is not")
        self._disk_args = (Path(args.get("disk_cache_dir") or Path(tempfile.gettempdir()) / "dynamo-kv-cache"),
                           int(disk_mb * (1 << 20))) if disk_mb else None
        if self.n_parallel < 1 or self.n_batch < 1 or self.n_ubatch < 1:
            raise UserError("--extra-engine-args: n_parallel, n_batch and n_ubatch must be at least 1")
        self.verbose = verbose
        self.scheduler = Scheduler(self.caches, n_batch=self.n_batch, n_threads_batch=self.n_threads_batch)
        self._llama: model.Llama | None = None
        self._samplers: Samplers | None = None
        # KV events and load metrics (attach); the scheduler thread tracks, the event loop publishes
        self.block_size = block_size
        self.kv_state = WorkerKvState()
        self.worker_id = 0
        self.publish_metrics: Publisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics_key: tuple[int, int, int] | None = None
        self._metrics_sent_at = 0.0
        self._metrics_timer: asyncio.TimerHandle | None = None
        self.adapters: dict[str, Adapter] = {}  # LoRA adapters served, by name (changed on the loop)
        self._unloaded: set[str] = set()  # names unloaded: a request still naming one is an error
        self._lora_lock = asyncio.Lock()  # one load or unload at a time

    # -- LoRA adapters (lora.py) ----------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> the file it was loaded from."""
        return {name: str(a.path) for name, a in self.adapters.items()}

    async def load_lora(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` as ``name`` (UserError: not an adapter of this model, or the name
        is taken); requests naming it run with it from now on."""
        async with self._lora_lock:
            if name in self.adapters:
                raise UserError(f"LoRA adapter {name!r} is already loaded")
            adapter = await asyncio.wrap_future(
                self.scheduler.call(lambda: load_adapter(self.scheduler.llama, name, Path(path))))
            self.adapters[name] = adapter
            self._unloaded.discard(name)

    async def unload_lora(self, name: str) -> None:
        """Stop serving ``name`` (UserError: not loaded); requests already running with it finish."""
        async with self._lora_lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise UserError(f"LoRA adapter {name!r} is not loaded")
            self._unloaded.add(name)
            await asyncio.wrap_future(self.scheduler.call(lambda: self.scheduler.retire(adapter)))

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self.scheduler.start()

    def _load(self) -> None:
        if self._disk_args is not None:
            root, max_bytes = self._disk_args
            try:
                self.caches.open_disk(root, max_bytes)
            except OSError as e:
                raise UserError(f"--extra-engine-args: disk_cache_dir {root}: {e}") from None
        tuner = None
        if self.n_threads is None and self.n_gpu_layers == 0 and self.cores > 1:
            tuner = serving_tuner(self.cores)
            threads = tuner.candidates[0]
        else:
            threads = self.n_threads or self.cores
        # a library that dies of SIGILL here would take the process with it: a child process asks first
        extra_bufts = preflight.require(self.path) if self.n_gpu_layers == 0 else True
        llama = model.load(self.path, n_parallel=self.n_parallel, n_ctx_seq=self.n_ctx_seq, n_batch=self.n_batch,
                           n_ubatch=self.n_ubatch, n_gpu_layers=self.n_gpu_layers, threads=threads,
                           threads_batch=self.n_threads_batch, type_k=self.type_k, type_v=self.type_v,
                           flash_attn=self.flash_attn, verbose=self.verbose, use_extra_bufts=extra_bufts)
        self._llama = llama
        if self.mmproj is not None:
            try:
                self.projector = Projector(self.mmproj, llama.model, threads=threads, verbose=self.verbose,
                                           use_gpu=self.n_gpu_layers > 0)
            except BaseException:
                model.free(llama)
                self._llama = None
                raise
            self.scheduler.projector = self.projector
            log.info("llama.cpp loaded the image projector %s: %d positions per image", self.mmproj.name,
                     self.projector.image_tokens)
        self._samplers = Samplers(llama, self.seed)
        self.caches.bind(llama, self.n_parallel)
        self.scheduler.bind(llama, self._samplers, tuner)
        log.info("llama.cpp loaded %s: %d parallel sequences of %d tokens, %s threads",
                 self.path.name, self.n_parallel, self.n_ctx_seq,
                 f"{'/'.join(map(str, tuner.candidates))} (tuned)" if tuner else threads)

    async def close(self) -> None:
        sched = self.scheduler
        sched.stop()
        if sched.thread is not None:
            await asyncio.to_thread(sched.thread.join, 30)
            if sched.thread.is_alive():  # stuck in llama.cpp: freeing under it would crash
                log.warning("llama.cpp scheduler did not stop; leaving the model to the process exit")
                return
        if self._llama is not None:
            sched.free_samplers()
            if self.projector is not None:
                self.projector.free()
            model.free(self._llama)
            self._llama = None
        if self.caches.disk_tier is not None:
            self.caches.disk_tier.close()
        tuner = sched.tuner
        log.debug("llama.cpp engine closed: %d steps, %d tokens decoded, %d prompt tokens reused, "
                  "thread switches %s (probes skipped %s), threads now %s", sched.steps,
                  sched.decoded_tokens, sched.reused_tokens, tuner.switches if tuner else "-",
                  tuner.skipped if tuner else "-", tuner.summary() if tuner else "-")

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
        with self.scheduler.cv:
            events = [(DEVICE, CLEARED_DATA), *self.caches.track()]
            self.scheduler.on_kv_changes = self._kv_changed
        for tier, data in events:
            self.kv_state.send(data, tier)
        self._metrics_changed()

    @property
    def image_tokens(self) -> int:
        """Positions an image takes in a prompt (0: started without --mmproj)."""
        return self.projector.image_tokens if self.projector is not None else 0

    @property
    def publishes_kv_events(self) -> bool:
        return True

    def kv_state_dump(self) -> dict[str, Any]:
        """Every cached block, as the events so far describe it (the recovery query)."""
        return self.kv_state.dump()

    @property
    def runtime_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"total_kv_blocks": self._total_blocks(), "max_num_seqs": self.n_parallel,
                                  "max_num_batched_tokens": self.n_batch, "kv_cache_block_size": self.block_size}
        if self.n_gpu_layers == 0:  # measured on CPUs only; with layers on a GPU the router keeps its default
            config[SUGGESTED_OVERLAP_WEIGHT] = ROUTER_OVERLAP_WEIGHT
        return config

    def _total_blocks(self) -> int:
        return self.n_parallel * (self.n_ctx_seq // self.block_size)

    def load_metrics(self, dp_rank: int = 0) -> dict[str, Any]:
        """ForwardPassMetrics, as the mocker's: busy slots, waiting requests, cached blocks / capacity."""
        total = max(1, self._total_blocks())
        cached = self.caches.cached_blocks()
        hits = list(self.scheduler.hits)
        return {
            "worker_stats": {"data_parallel_rank": 0,
                             "request_active_slots": self.scheduler.active(),
                             "request_total_slots": self.n_parallel,
                             "num_requests_waiting": len(self.scheduler.waiting)},
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
        key = self.scheduler.load_key()
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

    def _kv_changed(self, events: list[tuple[str, Any]]) -> None:
        """In the scheduler thread, after admitting or a step: hand the changes to the loop."""
        if self._loop is None:
            return
        if not events and self.scheduler.load_key() == self._metrics_key:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_kv_changes, events)
        except RuntimeError:  # the loop is closed
            pass

    # -- the asyncio side ---------------------------------------------------------------------
    async def export_prefix(self, tokens: list[int]) -> tuple[int, int, Any] | None:
        """For another worker (disagg/prefix_share.py): the state of the cache here sharing the longest
        prefix with ``tokens`` (tokens it covers, tokens shared, state): from the host tier at once when no
        slot shares more than an entry there, else exported between two steps."""
        found = await asyncio.to_thread(self.caches.lend_from_host, tokens)
        if found is not None:
            return found
        return await asyncio.wrap_future(self.scheduler.call(lambda: self.caches.export_prefix(tokens)))

    def keep_states_to_lend(self) -> None:
        """Lending from now on: each finished sequence's state is kept in the host tier, so a fetch of it
        need not wait for the engine's step (slots.py keep_finished)."""
        self.caches.keep_finished_states = True

    async def generate(self, request: PreprocessedRequest, context: Context,
                       state_io: Any = None, prefix_state: Any = None) -> AsyncIterator[EngineOutput]:
        if self.scheduler.thread is None or self._samplers is None:
            raise EngineError("llamacpp engine is not started")
        sc = request.stop_conditions
        prompt = list(request.token_ids)
        if not prompt:
            raise EngineError("empty prompt: nothing to decode")
        images: list[Any] = []
        if request.multi_modal_data:
            if self.projector is None:
                raise RequestError(f"{self.path.name} takes no images (start it with --mmproj PATH)", param="messages")
            if request.output_options.prompt_logprobs is not None:
                raise RequestError("prompt_logprobs cannot be combined with images", param="prompt_logprobs")
            prompt, images = await asyncio.to_thread(expand, prompt, request.multi_modal_data, self.projector)
        room = self.n_ctx_seq - len(prompt)
        if room <= 0:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {self.n_ctx_seq}")
        max_tokens = min(sc.max_tokens or room, room)
        eos = frozenset(request.eos_token_ids or ()) | frozenset(sc.stop_token_ids_hidden or ())
        if sc.ignore_eos:
            eos = frozenset(sc.stop_token_ids_hidden or ())
        loop = asyncio.get_running_loop()
        adapter = self.adapters.get(request.model) if request.model else None
        if adapter is None and request.model in self._unloaded:
            raise EngineError(f"LoRA adapter {request.model!r} is not loaded on this worker")
        oo = request.output_options
        req = Request(prompt, max_tokens, eos, request.sampling_options, context, asyncio.Queue(), loop,
                      grammar=self._samplers.grammar(request.sampling_options.guided_decoding), state_io=state_io,
                      prefix_state=None if isinstance(prefix_state, concurrent.futures.Future) else prefix_state,
                      logprobs=oo.logprobs, prompt_logprobs=oo.prompt_logprobs, stamps=context.stamps,
                      adapter=adapter, images=images)
        if isinstance(prefix_state, concurrent.futures.Future):
            # the state is being fetched: the request keeps its place in line meanwhile (scheduler.py)
            req.prefix_wait, req.prefix_deadline = prefix_state, time.monotonic() + PREFIX_WAIT_LIMIT_S
            prefix_state.add_done_callback(lambda _: self.scheduler.wake())
        self.scheduler.submit(req)
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
