"""``python -m dynamo.sglang --model-path M [SGLang's server flags]``: Dynamo 1.x's SGLang worker on our sglang
engine (``dynamo-run in=dyn://NS.backend.generate out=sglang M``).  SGLang's own flags are read with SGLang's
parser (``ServerArgs``) and those that differ from its defaults go to our engine as engine arguments;
``--page-size`` is our KV block size (KV routing uses it)."""

from __future__ import annotations

import argparse
from typing import Any

from dynamo.cli.v1.common import Opt, pos_int, refused
from dynamo.cli.v1.worker import WorkerModule, disagg_opt, engine_flag_diff, model_opts
from dynamo.errors import UserError
from dynamo.run_config import RunConfig


def apply(cfg: RunConfig, ns: Any, extra: dict[str, Any]) -> None:
    cfg.context_length = ns.context_length
    cfg.kv_cache_block_size = ns.page_size
    cfg.tensor_parallel_size = ns.tp_size or 1


def sglang_flags(model: str, argv: list[str]) -> dict[str, Any]:
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as e:
        raise UserError(f"SGLang's own flags ({' '.join(argv)}) need SGLang installed ({e})") from None
    parser = argparse.ArgumentParser(prog="sglang")
    ServerArgs.add_cli_args(parser)
    return engine_flag_diff(parser, "--model-path", model, argv)


REFUSE = [("--use-sglang-tokenizer", "DYN_SGL_USE_TOKENIZER", True), ("--gateway-workers", "DYN_SGL_GATEWAY_WORKERS", False),
          ("--enable-multimodal", "DYN_SGL_ENABLE_MULTIMODAL", True),
          ("--dedicated-mm-encoder", "DYN_SGL_DEDICATED_MM_ENCODER", True),
          ("--embedding-transfer-mode", "DYN_SGL_EMBEDDING_TRANSFER_MODE", False),
          ("--embedding-worker", "DYN_SGL_EMBEDDING_WORKER", True), ("--rerank-worker", "DYN_SGL_RERANK_WORKER", True),
          ("--image-diffusion-worker", "DYN_SGL_IMAGE_DIFFUSION_WORKER", True),
          ("--disagg-config", "DYN_SGL_DISAGG_CONFIG", False), ("--disagg-config-key", "DYN_SGL_DISAGG_CONFIG_KEY", False),
          ("--video-generation-worker", "DYN_SGL_VIDEO_GENERATION_WORKER", True),
          ("--enable-rl", "DYN_SGL_ENABLE_RL", True), ("--engine-route", "DYN_SGLANG_ENGINE_ROUTES", False),
          ("--sglang-trace-level", "SGLANG_TRACE_LEVEL", False)]

MODULE = WorkerModule("dynamo.sglang", "sglang", [
    *model_opts(name_flags=("--served-model-name",)),
    Opt(("--context-length",), "context_length", "SGLang's context length (ours too)", type=pos_int),
    Opt(("--page-size",), "page_size", "SGLang's KV page size (our --kv-cache-block-size)", type=pos_int),
    Opt(("--tp-size", "--tensor-parallel-size", "--tp"), "tp_size", "GPUs per model instance", type=pos_int),
    disagg_opt(),
], [refused(name, "a Dynamo SGLang-worker feature", env, switch=switch) if switch else
    refused(name, "a Dynamo SGLang-worker feature", env) for name, env, switch in REFUSE],
    passthrough=sglang_flags, apply=apply)

main = MODULE.main
