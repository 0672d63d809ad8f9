"""``python -m dynamo.trtllm --model M``: Dynamo 1.x's TensorRT-LLM worker on our trtllm engine
(``dynamo-run in=dyn://NS.backend.generate out=trtllm M``).  1.x's TensorRT-LLM flags are its own (not the
engine's parser): those with a counterpart map onto our flags, ``--extra-engine-args`` is the engine's YAML
file as ours, the rest are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamo.cli.v1.common import Opt, pos_int, refused
from dynamo.cli.v1.worker import WorkerModule, disagg_opt, model_opts
from dynamo.run_config import RunConfig


def apply(cfg: RunConfig, ns: Any, extra: dict[str, Any]) -> None:
    cfg.context_length = ns.max_seq_len
    cfg.kv_cache_block_size = ns.kv_block_size
    cfg.tensor_parallel_size = ns.tensor_parallel_size
    if ns.extra_engine_args:
        cfg.extra_engine_args = Path(ns.extra_engine_args).expanduser()


REFUSED = ["pipeline-parallel-size", "expert-parallel-size", "enable-attention-dp:s", "conversation-affinity:s",
           "conversation-affinity-dp-rank-source", "gpus-per-node", "max-batch-size", "max-num-tokens",
           "max-beam-width", "free-gpu-memory-fraction", "override-engine-args", "publish-kv-events:s",
           "publish-metrics:s", "load-format", "model-loader-extra-config", "enable-multimodal:s", "modality",
           "encode-endpoint", "allowed-local-media-path", "max-file-size-mb", "guided-decoding-backend",
           "quant-algo", "quant-dynamic:s", "enable-teacache:s", "teacache-use-ret-steps:s", "teacache-thresh",
           "torch-dtype", "revision", "disable-torch-compile:s", "enable-fullgraph:s", "enable-cuda-graph:s",
           "attn-backend", "dit-ulysses-size", "dit-ring-size", "dit-cfg-size", "enable-layerwise-nvtx-marker:s",
           "skip-warmup:s", "default-height", "default-width", "default-num-inference-steps",
           "default-guidance-scale", "default-num-frames", "default-num-images-per-prompt"]


def trtllm_refusals() -> list[Any]:
    out = []
    for item in REFUSED:
        name, _, kind = item.partition(":")
        env = "DYN_TRTLLM_" + name.upper().replace("-", "_")
        out.append(refused(f"--{name}", "a Dynamo TensorRT-LLM-worker setting; put engine settings in "
                           "--extra-engine-args YAML", env, switch=kind == "s"))
    return out


MODULE = WorkerModule("dynamo.trtllm", "trtllm", [
    *model_opts(model_flags=("--model", "--model-path"), name_flags=("--served-model-name",),
                env_prefix="DYN_TRTLLM_"),
    Opt(("--tensor-parallel-size",), "tensor_parallel_size", "GPUs per model instance",
        env="DYN_TRTLLM_TENSOR_PARALLEL_SIZE", default=1, type=pos_int),
    Opt(("--kv-block-size",), "kv_block_size", "KV block size (our --kv-cache-block-size)",
        env="DYN_TRTLLM_KV_BLOCK_SIZE", default=32, type=pos_int),
    Opt(("--max-seq-len",), "max_seq_len", "the context length (our --context-length)",
        env="DYN_TRTLLM_MAX_SEQ_LEN", type=pos_int),
    Opt(("--extra-engine-args",), "extra_engine_args", "the engine's YAML configuration file",
        env="DYN_TRTLLM_EXTRA_ENGINE_ARGS", metavar="FILE"),
    disagg_opt("DYN_TRTLLM_DISAGGREGATION_MODE"),
], trtllm_refusals(), apply=apply)

main = MODULE.main
