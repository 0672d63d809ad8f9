"""``python -m dynamo.mocker``: Dynamo 1.x's mocker command line, mapped onto ``dynamo-run in=dyn://...
out=mocker``.

The engine flags become our mocker's arguments (engines/mocker/args.py: Dynamo's mocker keys), then
``--extra-engine-args`` JSON overrides them, as 1.x says ("overrides individual CLI arguments"); the merged
arguments go to the engine as an ``--extra-engine-args`` file of our own (written next to nothing: a
temporary file, removed at exit).  ``--num-workers N`` runs N workers in this one process, as 1.x does:
each its own engine, runtime connection and instance id (cli/launch.py), started ``--stagger-delay``
seconds apart.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from dynamo.cli.v1.common import (
    Opt,
    Refused,
    Spec,
    apply_runtime,
    dump_config,
    entry,
    nonneg_float,
    pos_int,
    positive_float,
    refused,
    runtime_opts,
    worker_endpoint,
    worker_runtime_opts,
)
from dynamo.cli.v1.frontend import ais_refusals
from dynamo.engines.engine_args import read_json_args
from dynamo.errors import UserError
from dynamo.run_config import RunConfig

PROG = "dynamo.mocker"
NO_DELAY_RATIO = 1e9  # 1.x's --speedup-ratio 0 ("no simulation delays"): ours must be > 0
WORKER_ROUTER_WHY = "router settings a worker advertises to frontends; give the frontend its router flags here"
MAX_WORKERS = 256


def mocker_opts() -> list[Opt]:
    return [
        Opt(("--model-path",), "model_path", "the model folder or Hugging Face repo id (its tokenizer and "
            "config)", metavar="PATH"),
        Opt(("--model-name",), "model_name", "the name clients use (default: from the model path)"),
        Opt(("--num-gpu-blocks-override",), "num_gpu_blocks", "KV cache blocks per data-parallel rank "
            "(mocker num_gpu_blocks; default 16384)", type=pos_int),
        Opt(("--block-size",), "block_size", "tokens per KV block (default 64)", type=pos_int),
        Opt(("--max-model-len",), "max_model_len", "the model's context length (dynamo-run's --context-length; "
            "default: the model's)", type=pos_int),
        Opt(("--max-num-seqs",), "max_num_seqs", "sequences per step", default=256, type=pos_int),
        Opt(("--max-num-batched-tokens",), "max_num_batched_tokens", "tokens per step", default=8192,
            type=pos_int),
        Opt(("--enable-prefix-caching",), "enable_prefix_caching", "reuse cached prefixes", default=True,
            switch=True),
        Opt(("--enable-chunked-prefill",), "enable_chunked_prefill", "prefill long prompts in chunks",
            default=True, switch=True),
        Opt(("--speedup-ratio",), "speedup_ratio", "run the simulated time this many times faster (0: no "
            "delays)", default=1.0, type=nonneg_float),
        Opt(("--decode-speedup-ratio",), "decode_speedup_ratio", "an extra speedup of decode steps only (the "
            "effective decode speedup is speedup-ratio times this)", default=1.0, type=positive_float),
        Opt(("--data-parallel-size",), "dp_size", "data-parallel ranks (mocker dp_size; default 1)",
            type=pos_int),
        Opt(("--startup-time",), "startup_time", "seconds the simulated engine takes to start (each worker "
            "waits this long before it registers)", type=nonneg_float),
        Opt(("--num-workers",), "num_workers", "workers in this process, each with its own instance id",
            default=1, type=pos_int),
        Opt(("--stagger-delay",), "stagger_delay", "seconds between starting two workers (-1: 1.x's auto, "
            "0.1 s for 33-128 workers, 0.2 s above)", default=0.0, type=float),
        Opt(("--engine-type",), "engine_type", "the engine simulated: vllm's scheduler", default="vllm",
            only=("vllm",)),
        Opt(("--extra-engine-args",), "extra_engine_args", "JSON file of mocker arguments; overrides the "
            "flags", metavar="FILE"),
        Opt(("--disaggregation-mode",), "disaggregation_mode", "agg, prefill (prefill only, hands the KV "
            "state to a decode worker) or decode", choices=("agg", "prefill", "decode")),
        Opt(("--is-prefill-worker",), "is_prefill_worker", "deprecated: --disaggregation-mode prefill",
            default=False, switch=True, negatable=False),
        Opt(("--is-decode-worker",), "is_decode_worker", "deprecated: --disaggregation-mode decode",
            default=False, switch=True, negatable=False),
        Opt(("--kv-transfer-bandwidth",), "kv_transfer_bandwidth", "GB/s of the prefill-to-decode KV hand-over "
            "(0: no transfer delay; default 25)", type=nonneg_float),
        Opt(("--kv-bytes-per-token",), "kv_bytes_per_token", "KV state bytes per token (default 131072)",
            type=pos_int),
        Opt(("--kv-cache-dtype",), "kv_cache_dtype", "the KV cache's data type: auto (--kv-bytes-per-token "
            "says the size)", default="auto", choices=("auto", "bfloat16", "fp8", "fp8_ds_mla", "fp8_e4m3",
                                                      "fp8_e5m2", "fp8_inc"), only=("auto",)),
        *[o for o in runtime_opts()],
        *[o for o in worker_runtime_opts() if o.dest in ("namespace", "endpoint")],
    ]


def mocker_refusals() -> list[Refused]:
    out = [
        refused("--preemption-mode", "a choice of preemption order"),
        refused("--planner-profile-data", "profiled latency curves (ours: the built-in timing model)"),
        refused("--ais-perf-model --aic-perf-model", "the AISimulate perf model", switch=True),
        refused("--gpu-memory-utilization", "KV capacity estimation (give --num-gpu-blocks-override)"),
        refused("--mem-fraction-static", "KV capacity estimation (give --num-gpu-blocks-override)"),
        refused("--free-gpu-memory-fraction", "KV capacity estimation (give --num-gpu-blocks-override)"),
        refused("--reasoning", "simulated reasoning tokens"),
        refused("--response-replay-trace-path", "replaying recorded outputs"),
        refused("--sglang-generate", "SGLang's native /generate", switch=True),
        refused("--trtllm-capacity-scheduler-policy", "the TensorRT-LLM scheduler model"),
        refused("--zmq-kv-events-ports", "vLLM-format ZMQ KV events on fixed ports (ours go on the event plane)"),
        refused("--zmq-replay-ports", "vLLM-format ZMQ KV events on fixed ports (ours go on the event plane)"),
        refused("--bootstrap-ports", "bootstrap rendezvous (our prefill and decode workers meet through "
                "discovery)"),
        refused("--kv-transfer-timing-mode", "KV transfer timing modes"),
        refused("--num-host-blocks", "host KV offload in the mocker"),
        refused("--host-offload-d2h-bandwidth-gbps", "host KV offload in the mocker"),
        refused("--host-offload-h2d-bandwidth-gbps", "host KV offload in the mocker"),
    ]
    for name in ("schedule-policy", "page-size", "max-prefill-tokens", "chunked-prefill-size",
                 "clip-max-new-tokens", "schedule-conservativeness"):
        out.append(refused(f"--sglang-{name}", "the SGLang scheduler model (--engine-type vllm only)"))
    out += ais_refusals()
    for name, env in WORKER_ROUTER_FLAGS:
        first = name.split()[0]
        out.append(Refused(tuple(name.split()), WORKER_ROUTER_WHY, env,
                           takes_value=first not in WORKER_ROUTER_SWITCHES))
    return out


# the router flags 1.6.1's mocker takes, which a worker advertises to its frontends
WORKER_ROUTER_SWITCHES = {"--load-aware", "--no-load-aware", "--router-kv-events", "--router-replica-sync",
                          "--router-track-active-blocks", "--router-track-output-blocks",
                          "--router-assume-kv-reuse", "--router-track-prefill-tokens", "--use-remote-indexer",
                          "--enable-session-prefix-index", "--router-conditional-disagg"}
WORKER_ROUTER_FLAGS = [
    ("--router-mode", "DYN_ROUTER_MODE"),
    ("--router-session-affinity-ttl-secs", "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS"),
    ("--router-session-affinity-mode", "DYN_ROUTER_SESSION_AFFINITY_MODE"),
    ("--active-decode-blocks-threshold", "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"),
    ("--active-prefill-tokens-threshold", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD"),
    ("--active-prefill-tokens-threshold-frac", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"),
    ("--load-aware --no-load-aware", "DYN_ROUTER_LOAD_AWARE"),
    ("--router-kv-overlap-score-credit", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT"),
    ("--router-kv-overlap-score-credit-decay", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY"),
    ("--router-kv-overlap-score-weight --kv-overlap-score-weight", None),
    ("--router-prefill-load-scale", "DYN_ROUTER_PREFILL_LOAD_SCALE"),
    ("--router-decode-active-request-weight", "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT"),
    ("--router-host-cache-hit-weight", "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"),
    ("--router-disk-cache-hit-weight", "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"),
    ("--router-temperature", "DYN_ROUTER_TEMPERATURE"),
    ("--router-kv-events --no-router-kv-events --kv-events --no-kv-events", "DYN_ROUTER_USE_KV_EVENTS"),
    ("--router-replica-sync --no-router-replica-sync", "DYN_ROUTER_REPLICA_SYNC"),
    ("--router-track-active-blocks --no-router-track-active-blocks --track-active-blocks --no-track-active-blocks",
     "DYN_ROUTER_TRACK_ACTIVE_BLOCKS"),
    ("--router-track-output-blocks --no-router-track-output-blocks --track-output-blocks --no-track-output-blocks",
     "DYN_ROUTER_TRACK_OUTPUT_BLOCKS"),
    ("--router-assume-kv-reuse --no-router-assume-kv-reuse --assume-kv-reuse --no-assume-kv-reuse",
     "DYN_ROUTER_ASSUME_KV_REUSE"),
    ("--router-track-prefill-tokens --no-router-track-prefill-tokens", "DYN_ROUTER_TRACK_PREFILL_TOKENS"),
    ("--router-tracking-hash", "DYN_ROUTER_TRACKING_HASH"),
    ("--router-tracking-key-file", "DYN_ROUTER_TRACKING_KEY_FILE"),
    ("--router-tracking-key-id", "DYN_ROUTER_TRACKING_KEY_ID"),
    ("--router-prefill-load-model", "DYN_ROUTER_PREFILL_LOAD_MODEL"),
    ("--router-ttl-secs", "DYN_ROUTER_TTL_SECS"),
    ("--router-approximate-cache-policy", "DYN_ROUTER_APPROXIMATE_CACHE_POLICY"),
    ("--router-queue-threshold", "DYN_ROUTER_QUEUE_THRESHOLD"),
    ("--router-policy-config", "DYN_ROUTER_POLICY_CONFIG"),
    ("--router-conditional-disagg --no-router-conditional-disagg", "DYN_ROUTER_CONDITIONAL_DISAGG"),
    ("--router-conditional-disagg-config", "DYN_ROUTER_CONDITIONAL_DISAGG_CONFIG"),
    ("--router-prefill-policy", "DYN_ROUTER_PREFILL_POLICY"),
    ("--router-decode-policy", "DYN_ROUTER_DECODE_POLICY"),
    ("--router-event-threads", "DYN_ROUTER_EVENT_THREADS"),
    ("--router-queue-policy", "DYN_ROUTER_QUEUE_POLICY"),
    ("--use-remote-indexer --no-use-remote-indexer", "DYN_USE_REMOTE_INDEXER"),
    ("--enable-session-prefix-index --no-enable-session-prefix-index", "DYN_ENABLE_SESSION_PREFIX_INDEX"),
    ("--shared-cache-multiplier", "DYN_SHARED_CACHE_MULTIPLIER"),
    ("--shared-cache-type", "DYN_SHARED_CACHE_TYPE"),
    ("--router-predicted-ttl-secs", "DYN_ROUTER_PREDICTED_TTL_SECS"),
]


def spec() -> Spec:
    return Spec(PROG, "Dynamo 1.x's mocker (a simulated vLLM worker with KV events) on dynamo-run's: "
                "dynamo-run in=dyn://NS.backend.generate out=mocker MODEL with these flags mapped "
                "(docs/cli-1x.md).", mocker_opts(), mocker_refusals())


def mocker_args(ns: Any) -> dict[str, Any]:
    """The mocker arguments the flags give, then the ``--extra-engine-args`` file's over them."""
    args: dict[str, Any] = {"max_num_seqs": ns.max_num_seqs, "max_num_batched_tokens": ns.max_num_batched_tokens,
                            "enable_prefix_caching": ns.enable_prefix_caching,
                            "enable_chunked_prefill": ns.enable_chunked_prefill,
                            "speedup_ratio": ns.speedup_ratio or NO_DELAY_RATIO,
                            "decode_speedup_ratio": ns.decode_speedup_ratio}
    for key, value in (("num_gpu_blocks", ns.num_gpu_blocks), ("block_size", ns.block_size),
                       ("dp_size", ns.dp_size), ("kv_bytes_per_token", ns.kv_bytes_per_token)):
        if value is not None:
            args[key] = value
    if ns.kv_transfer_bandwidth is not None:
        if ns.kv_transfer_bandwidth == 0:  # 1.x: no transfer delay
            args.update(kv_transfer_bandwidth_gbps=NO_DELAY_RATIO, kv_transfer_latency_ms=0.0)
        else:
            args["kv_transfer_bandwidth_gbps"] = ns.kv_transfer_bandwidth
    if ns.extra_engine_args:
        args.update(read_json_args(Path(ns.extra_engine_args).expanduser()))
    from dynamo.engines.mocker.args import MockerArgs

    MockerArgs.from_dict(args)  # unknown keys and bad values: one line now
    return args


def disagg_mode(ns: Any) -> str:
    if ns.is_prefill_worker and ns.is_decode_worker:
        raise UserError("--is-prefill-worker and --is-decode-worker together")
    legacy = "prefill" if ns.is_prefill_worker else "decode" if ns.is_decode_worker else None
    if legacy and ns.disaggregation_mode and ns.disaggregation_mode != legacy:
        raise UserError(f"--is-{legacy}-worker and --disaggregation-mode {ns.disaggregation_mode} disagree")
    return ns.disaggregation_mode or legacy or "agg"


def stagger(ns: Any) -> float:
    if ns.stagger_delay >= 0:
        return float(ns.stagger_delay)
    if ns.stagger_delay != -1:
        raise UserError(f"--stagger-delay {ns.stagger_delay}: seconds, or -1 for auto")
    return 0.2 if ns.num_workers > 128 else 0.1 if ns.num_workers > 32 else 0.0


def build(argv: list[str], env: Mapping[str, str] | None = None) -> tuple[RunConfig, dict[str, str]]:
    ns, _, env_out = spec().parse(argv, env)
    if not ns.model_path:
        raise UserError("--model-path is required (the model's tokenizer and config)")
    if ns.num_workers > MAX_WORKERS:
        raise UserError(f"--num-workers {ns.num_workers}: at most {MAX_WORKERS} in one process")
    mode = disagg_mode(ns)
    args = mocker_args(ns)
    cfg = RunConfig(input=worker_endpoint(ns, prefill=mode == "prefill"), output="mocker", model=ns.model_path,
                    model_name=ns.model_name, context_length=ns.max_model_len, disaggregation_mode=mode,
                    num_workers=ns.num_workers, worker_stagger=stagger(ns))
    if "block_size" in args:
        cfg.kv_cache_block_size = int(args["block_size"])
    cfg.worker_start_delay = ns.startup_time or 0.0
    apply_runtime(cfg, ns)
    cfg.extra_engine_args = write_args(args)
    if ns.dump_config_to:
        dump_config(ns.dump_config_to, PROG, ns, cfg, {"mocker_args": args, "environment_set": env_out})
    return cfg, env_out


def write_args(args: dict[str, Any]) -> Path:
    """The merged mocker arguments as the engine's ``--extra-engine-args`` file (removed at exit)."""
    fd, name = tempfile.mkstemp(prefix="dynamo-mocker-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(args, f)
    atexit.register(_unlink, name)
    return Path(name)


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    return entry(build, argv)
