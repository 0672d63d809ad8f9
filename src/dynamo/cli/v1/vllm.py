"""``python -m dynamo.vllm --model M [vLLM's engine flags]``: Dynamo 1.x's vLLM worker on our vllm engine
(``dynamo-run in=dyn://NS.backend.generate out=vllm M``).

vLLM's own flags are read with vLLM's own parser (``AsyncEngineArgs``), as 1.x does, and those that differ
from vLLM's defaults go to our engine as engine arguments; a few that our model card must know too
(``--block-size``: KV routing; ``--max-model-len``: the context length; ``--tensor-parallel-size``) are
mapped onto our flags.  Dynamo's own vLLM-worker flags we do not implement are refused.
"""

from __future__ import annotations

from typing import Any

from dynamo.cli.v1.common import Opt, pos_int, refused
from dynamo.cli.v1.worker import WorkerModule, disagg_opt, engine_flag_diff, model_opts
from dynamo.errors import UserError
from dynamo.run_config import RunConfig


def apply(cfg: RunConfig, ns: Any, extra: dict[str, Any]) -> None:
    cfg.context_length = ns.max_model_len
    cfg.kv_cache_block_size = ns.block_size
    cfg.tensor_parallel_size = ns.tensor_parallel_size or 1


def vllm_flags(model: str, argv: list[str]) -> dict[str, Any]:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            from vllm.utils import FlexibleArgumentParser
    except ImportError as e:
        raise UserError(f"vLLM's own flags ({' '.join(argv)}) need vLLM installed ({e}); "
                        "scripts/test-vllm.sh sets up a virtualenv with it") from None
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm"))
    return engine_flag_diff(parser, "--model", model, argv)


REFUSE = [("--use-vllm-tokenizer", "DYN_VLLM_USE_TOKENIZER", True), ("--route-to-encoder", "DYN_VLLM_ROUTE_TO_ENCODER", True),
          ("--enable-multimodal", "DYN_VLLM_ENABLE_MULTIMODAL", True), ("--enable-rl", "DYN_ENABLE_RL", True),
          ("--mm-prompt-template", "DYN_VLLM_MM_PROMPT_TEMPLATE", False),
          ("--custom-encoder-class", "DYN_CUSTOM_ENCODER_CLASS", False),
          ("--embedding-transfer-mode", "DYN_VLLM_EMBEDDING_TRANSFER_MODE", False),
          ("--embedding-worker", "DYN_VLLM_EMBEDDING_WORKER", True),
          ("--embedding-frontend-tokenization", "DYN_VLLM_EMBEDDING_FRONTEND_TOKENIZATION", True),
          ("--embedding-worker-processes", "DYN_VLLM_EMBEDDING_WORKER_PROCESSES", False),
          ("--realtime", "DYN_VLLM_REALTIME", True), ("--classify-worker", "DYN_VLLM_CLASSIFY_WORKER", True),
          ("--headless", "DYN_VLLM_HEADLESS", True), ("--model-express-url", "MODEL_EXPRESS_URL", False),
          ("--gms-shadow-mode", "DYN_VLLM_GMS_SHADOW_MODE", True), ("--benchmark-mode", "DYN_BENCHMARK_MODE", False),
          ("--benchmark-points-file", "DYN_BENCHMARK_POINTS_FILE", False),
          ("--is-prefill-worker", None, True), ("--is-decode-worker", None, True)]

MODULE = WorkerModule("dynamo.vllm", "vllm", [
    *model_opts(model_flags=("--model",), name_flags=("--served-model-name",)),
    Opt(("--max-model-len",), "max_model_len", "vLLM's context length (our --context-length)", type=pos_int),
    Opt(("--block-size",), "block_size", "vLLM's KV block size (our --kv-cache-block-size: KV routing uses it)",
        type=pos_int),
    Opt(("--tensor-parallel-size", "-tp"), "tensor_parallel_size", "GPUs per model instance", type=pos_int),
    disagg_opt("DYN_VLLM_DISAGGREGATION_MODE", ("agg", "pd", "prefill", "decode", "encode")),
], [refused(name, "a Dynamo vLLM-worker feature", env, switch=switch) if switch else
    refused(name, "a Dynamo vLLM-worker feature", env) for name, env, switch in REFUSE],
    passthrough=vllm_flags, apply=apply)

main = MODULE.main
