"""``out=trtllm``: TensorRT-LLM's LLM API (``tensorrt_llm.LLM``) in this process, token ids in and out.

**Not run on the project's machines**: TensorRT-LLM needs CUDA.  The argument mapping (including the YAML
``--extra-engine-args``) and the request/response conversion are pure functions below, unit-tested with
objects shaped like TensorRT-LLM's (tests/unit/engines/test_engine_args.py); the engine class is a thin shell.

* ``LLM(model=..., skip_tokenizer_init=True, ...)``: our pre-processor tokenizes and our post-processor
  detokenizes and applies stop strings, so requests carry token ids and ``detokenize=False``.
* Requests: ``llm.generate_async(token_ids, sampling_params=SamplingParams(...), streaming=True)``; each
  streamed result's ``outputs[0].token_ids_diff`` holds the new tokens; a request whose consumer stops
  is aborted with ``result.abort()``.
* Arguments, in increasing precedence: ``model`` (HF folder), ``tensor_parallel_size``,
  ``gpus_per_node`` (``--tensor-parallel-size`` / ``--num-nodes``), ``max_seq_len``
  (``--context-length``), ``kv_cache_config.tokens_per_block`` (``--kv-cache-block-size``), then the
  ``--extra-engine-args`` YAML file (as the original: e.g. ``backend: pytorch`` and
  ``kv_cache_config: {event_buffer_max_size: 1024}``), merged key by key into nested mappings.  Unknown
  keys are rejected by TensorRT-LLM's own argument validation.  A ``backend`` key picks the LLM class:
  ``pytorch`` (or absent) ``tensorrt_llm.LLM``, ``tensorrt`` the TensorRT-engine ``LLM``,
  ``_autodeploy`` AutoDeploy's ``LLM``.
* Multi-node: TensorRT-LLM runs its ranks under MPI (``mpirun ... trtllm-llmapi-launch dynamo-run ...``)
  or its Ray orchestrator; ``--node-rank`` and ``--leader-addr`` are not LLM API arguments, so they are
  only checked and logged.  ``--base-gpu-id`` sets ``CUDA_VISIBLE_DEVICES`` like ``out=vllm``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from dynamo.engines.token_engine_common import (
    apply_base_gpu_id,
    common_sampling_params,
    completion_finish_reason,
    cuda_visible_devices,  # noqa: F401  (``trtllm.cuda_visible_devices``: --base-gpu-id works as for out=vllm)
    engine_eos_ids,
    engine_start_errors,
    gpus_per_node,
    one_line,
    relay_outputs,
)
from dynamo.errors import EngineError, UserError
from dynamo.kv.engine_sources import (
    PublishesEngineKvEvents,
    TrtllmKvEvents,
    serves_router,
    trtllm_kv_events_wanted,
)
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import (
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
)
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install tensorrt-llm (TensorRT-LLM needs an NVIDIA GPU with CUDA)"
BACKENDS = ("pytorch", "tensorrt", "_autodeploy")


def load_extra_args(path: Path | None) -> dict[str, Any]:
    """The ``--extra-engine-args`` YAML (JSON is YAML too) as a dict; a bad file is a clear error."""
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--extra-engine-args {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UserError(f"--extra-engine-args {path}: not a text file") from None
    except yaml.YAMLError as e:
        raise UserError(f"--extra-engine-args {path}: not valid YAML: {one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--extra-engine-args {path}: expected a YAML mapping of argument names to values")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; nested mappings are merged key by key, everything else replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def engine_args(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``LLM(**kwargs)`` for this run (``backend`` included when given; :func:`split_backend` takes it)."""
    if card.path is not None:
        model = str(card.path)
    elif card.gguf_path is not None:
        raise UserError("out=trtllm does not load GGUF files: give a Hugging Face folder or repo id")
    else:
        raise UserError("out=trtllm needs a model: a Hugging Face folder or repo id")
    tp = int(cfg.tensor_parallel_size or 1)
    num_nodes = int(cfg.num_nodes or 1)
    args: dict[str, Any] = {"model": model, "skip_tokenizer_init": True, "tensor_parallel_size": tp}
    if num_nodes > 1:
        args["gpus_per_node"] = gpus_per_node(tp, num_nodes)
    if cfg.context_length is not None:
        args["max_seq_len"] = int(cfg.context_length)
    if cfg.kv_cache_block_size is not None:
        args["kv_cache_config"] = {"tokens_per_block": int(cfg.kv_cache_block_size)}
    return deep_merge(args, extra or {})


def split_backend(args: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(backend, the rest): ``backend`` chooses the LLM class rather than being an argument of it."""
    rest = dict(args)
    backend = rest.pop("backend", None) or "pytorch"
    if backend not in BACKENDS:
        raise UserError(f"--extra-engine-args: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return str(backend), rest


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` keyword arguments for a pre-processed request.

    ``end_id`` is the first EOS id (the tokenizer is not loaded, so TensorRT-LLM cannot find it), the
    other EOS ids and the request's stop token ids are ``stop_token_ids``; stop strings stay with our
    post-processor.
    """
    sc, so, oo = request.stop_conditions, request.sampling_options, request.output_options
    params: dict[str, Any] = {"detokenize": False}
    if sc.max_tokens is not None:
        params["max_tokens"] = int(sc.max_tokens)
    if sc.min_tokens:
        params["min_tokens"] = int(sc.min_tokens)
    params.update(common_sampling_params(request, "trtllm"))
    eos = engine_eos_ids(request)
    if eos:
        params["end_id"] = eos[0]
        params["pad_id"] = eos[0]
    else:
        params["end_id"] = -1  # nothing ends the sequence but length and stop tokens
    # the end_id ends the sequence already: not a stop token as well
    stop_ids = [tok for tok in params.pop("stop_token_ids", []) if tok != params["end_id"]]
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    if so.top_k is not None and so.top_k > 0:
        params["top_k"] = int(so.top_k)
    if so.temperature is not None and so.temperature <= 0:
        # greedy: TensorRT-LLM wants temperature > 0; top_k 1 is its greedy
        params.pop("temperature")
        params["top_k"] = 1
        params.pop("top_p", None)
    if so.seed is not None:
        params["seed"] = int(so.seed)
    if oo.logprobs is not None:
        params["logprobs"] = int(oo.logprobs)
    return params


def finish_reason(reason: Any, stop_reason: Any, eos_token_ids: list[int] | tuple[int, ...]) -> Any:
    """TensorRT-LLM's ``CompletionOutput.finish_reason``/``stop_reason`` -> ours."""
    if reason == "timeout":
        return {"error": "TensorRT-LLM: the request timed out"}
    return completion_finish_reason(reason, stop_reason, eos_token_ids, cancelled="cancelled",
                                    engine="TensorRT-LLM")


def convert_output(result: Any, eos_token_ids: list[int] | tuple[int, ...]) -> EngineOutput:
    """One streamed ``GenerationResult`` -> our :class:`EngineOutput` (its new tokens only)."""
    outputs = getattr(result, "outputs", None) or []
    if not outputs:
        return EngineOutput(finish_reason=FINISH_STOP if getattr(result, "finished", False) else None)
    choice = outputs[0]
    ids = [int(t) for t in (choice.token_ids_diff or [])]
    reason = finish_reason(choice.finish_reason, getattr(choice, "stop_reason", None), eos_token_ids)
    if reason is None and getattr(result, "finished", False):
        reason = FINISH_STOP
    return EngineOutput(token_ids=ids, finish_reason=reason)


def _llm_class(backend: str) -> Any:
    if backend == "tensorrt":
        from tensorrt_llm._tensorrt_engine import LLM
    elif backend == "_autodeploy":
        from tensorrt_llm._torch.auto_deploy import LLM
    else:
        from tensorrt_llm import LLM
    return LLM


class TrtllmEngine(PublishesEngineKvEvents):
    kind = "core"

    def __init__(self, cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None,
                 extra_path: Path | None = None):
        self.cfg = cfg
        self.card = card
        self.backend, self.args = split_backend(engine_args(cfg, card, extra))
        self.extra_path = extra_path
        self._llm: Any = None
        self._SamplingParams: Any = None
        # KV events for a KV router (a dyn:// worker with block reuse; engine_kv_events.py)
        self._kv: TrtllmKvEvents | None = None
        why_not = trtllm_kv_events_wanted(cfg, self.args)
        if why_not is None:
            TrtllmKvEvents.configure(self.args)
            self._kv = TrtllmKvEvents(card.kv_cache_block_size)
        elif serves_router(cfg):
            log.info("trtllm: no KV events for the router: %s", why_not)
        if int(cfg.num_nodes or 1) > 1:
            log.info("trtllm: %s nodes; TensorRT-LLM places its ranks through MPI or Ray, so --node-rank %s and "
                     "--leader-addr %s are not passed to it", cfg.num_nodes, cfg.node_rank, cfg.leader_addr)

    async def start(self) -> None:
        try:
            import tensorrt_llm  # noqa: F401
        except ImportError as e:
            raise UserError(f"out=trtllm cannot import TensorRT-LLM ({one_line(e)}): {INSTALL_HINT}") from None
        visible = apply_base_gpu_id(int(getattr(self.cfg, "base_gpu_id", 0) or 0),
                                    int(self.args.get("gpus_per_node") or self.args.get("tensor_parallel_size") or 1))
        if visible is not None:
            log.info("trtllm: --base-gpu-id %s: CUDA_VISIBLE_DEVICES=%s", self.cfg.base_gpu_id, visible)
        from tensorrt_llm import SamplingParams

        self._SamplingParams = SamplingParams
        LLM = _llm_class(self.backend)
        where = f"--extra-engine-args {self.extra_path}: " if self.extra_path else ""
        log.info("starting TensorRT-LLM (%s backend) for %s", self.backend, self.card.display_name)
        with engine_start_errors("TensorRT-LLM", where):
            self._llm = await asyncio.to_thread(lambda: LLM(**self.args))
        max_seq_len = getattr(getattr(self._llm, "args", None), "max_seq_len", None)
        if max_seq_len:
            self.card.context_length = int(max_seq_len)
        kv = getattr(getattr(self._llm, "args", None), "kv_cache_config", None)
        block = getattr(kv, "tokens_per_block", None)
        if block:
            self.card.kv_cache_block_size = int(block)
        if self._kv is not None:
            self._kv.set_block_size(self.card.kv_cache_block_size)
            self._kv.start(self._llm)

    async def close(self) -> None:
        kv, self._kv = self._kv, None
        if kv is not None:
            await kv.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        llm = self._llm
        if llm is None:
            raise EngineError("trtllm engine is not started")
        try:
            params = self._SamplingParams(**sampling_params(request))
        except UserError as e:
            raise EngineError(str(e)) from None
        except (TypeError, ValueError) as e:
            raise EngineError(f"TensorRT-LLM rejected the sampling parameters: {one_line(e)}") from None
        eos = request.eos_token_ids or self.card.eos_token_ids
        result = llm.generate_async(list(request.token_ids), sampling_params=params, streaming=True)
        # abort: the request's own GenerationResult.abort() (a plain call)
        async with aclosing(relay_outputs(result, lambda step: convert_output(step, eos), context, result.abort,
                                          engine="TensorRT-LLM", log=log, tag="trtllm",
                                          request_id=context.id)) as items:
            async for item in items:
                yield item


def create(cfg: RunConfig, card: ModelCard, extra_path: Path | None) -> TrtllmEngine:
    return TrtllmEngine(cfg, card, load_extra_args(extra_path), extra_path)
