"""``python -m dynamo.llama_cpp --model-path X.gguf``: the worker module Dynamo had until 0.5 dropped llama.cpp,
revived on our llamacpp engine (``dynamo-run in=dyn://NS.backend.generate out=llamacpp X.gguf``).  Its engine
settings are our llamacpp engine's ``--extra-engine-args`` keys (docs/engines.md: n_parallel, n_batch,
n_gpu_layers, ...)."""

from __future__ import annotations

from typing import Any

from dynamo.cli.v1.common import Opt, pos_int
from dynamo.cli.v1.worker import WorkerModule, disagg_opt, model_opts
from dynamo.run_config import RunConfig


def apply(cfg: RunConfig, ns: Any, extra: dict[str, Any]) -> None:
    cfg.context_length = ns.context_length
    cfg.kv_cache_block_size = ns.kv_block_size
    cfg.mmproj = ns.mmproj


MODULE = WorkerModule("dynamo.llama_cpp", "llamacpp", [
    *model_opts(),
    Opt(("--context-length",), "context_length", "the context length (default: the GGUF's, capped by the "
        "engine)", type=pos_int),
    Opt(("--kv-block-size", "--kv-cache-block-size"), "kv_block_size", "tokens per KV block for routing "
        "(default 16)", type=pos_int),
    Opt(("--extra-engine-args",), "extra_engine_args", "JSON file of llamacpp engine arguments", metavar="FILE"),
    Opt(("--mmproj",), "mmproj", "the model's image projector (an mmproj GGUF)", metavar="PATH"),
    disagg_opt(),
], [], apply=apply)

main = MODULE.main
