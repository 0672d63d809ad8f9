"""``python -m dynamo.frontend``: Dynamo 1.x's frontend command line, mapped onto ``dynamo-run in=http out=dyn``.

The flags, their variables and defaults are 1.6.1's (its ``--help``); each is taken here (the same thing,
or mapped onto our flag) or refused in one line, as docs/cli-1x.md lists.  Where our defaults differ on
purpose they stay ours and the table says so: discovery with nothing said is our one-machine rule (etcd when
``ETCD_ENDPOINTS`` is set or etcd answers on localhost:2379, else the file store) where 1.x would wait for
an etcd; ``--router-replica-sync`` defaults on (docs/routing.md, "Several frontends").
"""

from __future__ import annotations

from typing import Mapping

from dynamo.cli.v1.common import (
    Opt,
    Refused,
    Spec,
    apply_runtime,
    dump_config,
    entry,
    nonneg_float,
    nonneg_int,
    port,
    refused,
    runtime_opts,
    tcp_tls_opts,
)
from dynamo.errors import UserError
from dynamo.run_config import RunConfig

PROG = "dynamo.frontend"
ROUTER_MODES = ("round-robin", "random", "power-of-two", "kv", "direct", "least-loaded", "device-aware-weighted")
OUR_ROUTER_MODES = ("round-robin", "random", "kv")

COST_WHY = "1.6's router cost terms; ours weighs overlap against load with --kv-overlap-score-weight"
POLICY_WHY = "1.6's router policy configuration"
AIS_WHY = "the AISimulate perf model"


def frontend_opts() -> list[Opt]:
    return [
        Opt(("-i", "--interactive"), "interactive", "text chat in the terminal instead of the HTTP server "
            "(dynamo-run in=text out=dyn)", env="DYN_INTERACTIVE", default=False, switch=True),
        Opt(("--http-host",), "http_host", "address to listen on", env="DYN_HTTP_HOST", default="0.0.0.0"),
        Opt(("--http-port",), "http_port", "port to listen on", env="DYN_HTTP_PORT", default=8000, type=port),
        Opt(("--tls-cert-path",), "tls_cert_path", "serve HTTPS with this certificate (PEM)",
            env="DYN_TLS_CERT_PATH", metavar="PEM"),
        Opt(("--tls-key-path",), "tls_key_path", "the certificate's private key (PEM)", env="DYN_TLS_KEY_PATH",
            metavar="PEM"),
        Opt(("--namespace",), "namespace", "serve only the models registered in this namespace (default: all)",
            env="DYN_NAMESPACE"),
        Opt(("--namespace-prefix",), "namespace_prefix", "serve only the models of namespaces whose names start "
            "with this (wins over --namespace)", env="DYN_NAMESPACE_PREFIX"),
        Opt(("--migration-limit",), "migration_limit", "times a request may move to another worker when its "
            "worker dies or freezes", env="DYN_MIGRATION_LIMIT", default=0, type=nonneg_int),
        Opt(("--metrics-prefix",), "metrics_prefix", "prefix of the frontend's metrics (DYN_METRICS_PREFIX; "
            "unset: dynamo_frontend)", env="DYN_METRICS_PREFIX", env_to="DYN_METRICS_PREFIX"),
        Opt(("--enable-anthropic-api",), "enable_anthropic_api", "serve Anthropic's /v1/messages too",
            env="DYN_ENABLE_ANTHROPIC_API", default=False, switch=True),
        Opt(("--strip-anthropic-preamble",), "strip_anthropic_preamble", "strip Claude Code's billing preamble: "
            "not done here, so only the --no- form is taken", env="DYN_STRIP_ANTHROPIC_PREAMBLE", default=False,
            switch=True, only=(False,)),
        Opt(("--router-mode",), "router_mode", "how a worker is picked", env="DYN_ROUTER_MODE",
            default="round-robin", choices=ROUTER_MODES, only=OUR_ROUTER_MODES),
        Opt(("--router-temperature",), "router_temperature", "KV router: softmax temperature, 0 picks the best",
            env="DYN_ROUTER_TEMPERATURE", default=0.0, type=nonneg_float),
        Opt(("--router-kv-events", "--kv-events"), "use_kv_events", "KV router: follow the workers' KV events "
            "(--no-: predict the cache from the router's own decisions)", env="DYN_ROUTER_USE_KV_EVENTS",
            default=True, switch=True),
        Opt(("--router-replica-sync",), "router_replica_sync", "KV router: share in-flight requests with the "
            "other frontends (default on here; 1.x: off)", env="DYN_ROUTER_REPLICA_SYNC", default=True,
            switch=True),
        Opt(("--router-kv-overlap-score-weight", "--kv-overlap-score-weight"), "kv_overlap_score_weight",
            "KV router: blocks of decode load one cached prefill block is worth (default: what the workers' "
            "engine suggests, else 2.0)", env="DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", type=nonneg_float),
        Opt(("--router-track-active-blocks", "--track-active-blocks"), "track_active_blocks",
            "KV router: count active blocks in the load (always here)", env="DYN_ROUTER_TRACK_ACTIVE_BLOCKS",
            default=True, switch=True, only=(True,)),
        Opt(("--router-assume-kv-reuse", "--assume-kv-reuse"), "assume_kv_reuse", "KV router: in-flight blocks "
            "share cached prefixes (always here)", env="DYN_ROUTER_ASSUME_KV_REUSE", default=True, switch=True,
            only=(True,)),
        Opt(("--router-track-output-blocks", "--track-output-blocks"), "track_output_blocks",
            "KV router: add output blocks to the load as tokens come (not here)",
            env="DYN_ROUTER_TRACK_OUTPUT_BLOCKS", default=False, switch=True, only=(False,)),
        Opt(("--router-track-prefill-tokens",), "track_prefill_tokens", "KV router: prompt tokens count in "
            "the load (always here)", env="DYN_ROUTER_TRACK_PREFILL_TOKENS", default=True, switch=True,
            only=(True,)),
        Opt(("--enforce-disagg",), "enforce_disagg", "deprecated in 1.6.1, which accepts and ignores it: "
            "prefill workers are used when they register", env="DYN_ENFORCE_DISAGG", default=False, switch=True),
        Opt(("--reasoning-field-name",), "reasoning_field_name", "the response field reasoning goes in",
            env="DYN_REASONING_FIELD_NAME", default="reasoning_content", choices=("reasoning_content", "reasoning"),
            only=("reasoning_content",)),
        Opt(("--dyn-chat-processor",), "chat_processor", "who templates and parses: ours (dynamo)",
            env="DYN_CHAT_PROCESSOR", default="dynamo", choices=("dynamo", "vllm", "sglang"), only=("dynamo",)),
        Opt(("--dyn-preprocess-workers",), "preprocess_workers", "processes for pre/post-processing: 0 (in the "
            "event loop; --http-workers N runs N frontends instead)", env="DYN_PREPROCESS_WORKERS", default=0,
            type=nonneg_int, only=(0,)),
        Opt(("--tokenizer",), "tokenizer", "tokenizer backend: Hugging Face tokenizers (default)",
            env="DYN_TOKENIZER", default="default", choices=("default", "fastokens", "basetenkenizer"),
            only=("default",)),
        Opt(("--tokenizer-fallback",), "tokenizer_fallback", "fall back to Hugging Face tokenizers: the only "
            "backend here", env="DYN_TOKENIZER_FALLBACK", default=True, switch=True, only=(True,)),
        Opt(("--trust-remote-code",), "trust_remote_code", "run a model's own tokenizer code: never here",
            env="DYN_TRUST_REMOTE_CODE", default=False, switch=True, only=(False,)),
        Opt(("--serve-indexer",), "serve_indexer", "serve the router's KV indexer: not here",
            env="DYN_SERVE_INDEXER", default=False, switch=True, only=(False,)),
        Opt(("--kserve-grpc-server",), "kserve_grpc_server", "KServe gRPC server: not here",
            env="DYN_KSERVE_GRPC_SERVER", default=False, switch=True, only=(False,)),
        Opt(("--enable-streaming-tool-dispatch",), "streaming_tool_dispatch", "extra tool_call_dispatch SSE "
            "events: not here", env="DYN_ENABLE_STREAMING_TOOL_DISPATCH", default=False, switch=True,
            only=(False,)),
        Opt(("--enable-streaming-reasoning-dispatch",), "streaming_reasoning_dispatch", "extra "
            "reasoning_dispatch SSE events: not here", env="DYN_ENABLE_STREAMING_REASONING_DISPATCH",
            default=False, switch=True, only=(False,)),
        Opt(("--dyn-debug-perf",), "debug_perf", "pre-processing timing logs: not here", env="DYN_DEBUG_PERF",
            default=False, switch=True, only=(False,)),
        Opt(("--router-prefill-load-model",), "prefill_load_model", "KV router prompt-side load model: none",
            env="DYN_ROUTER_PREFILL_LOAD_MODEL", default="none", choices=("none", "ais"), only=("none",)),
        Opt(("--shared-cache-type",), "shared_cache_type", "an external shared KV cache: none",
            env="DYN_SHARED_CACHE_TYPE", default="none", choices=("none", "hicache"), only=("none",)),
        Opt(("--use-remote-indexer",), "use_remote_indexer", "a remote KV indexer: not here",
            env="DYN_USE_REMOTE_INDEXER", default=False, switch=True, only=(False,)),
        Opt(("--enable-session-prefix-index",), "session_prefix_index", "a per-session prefix index: not here",
            env="DYN_ENABLE_SESSION_PREFIX_INDEX", default=False, switch=True, only=(False,)),
        Opt(("--router-conditional-disagg",), "conditional_disagg", "1.6's conditional disaggregation "
            "(ours: prompts short of --max-local-prefill-length prefill on the decode worker)",
            env="DYN_ROUTER_CONDITIONAL_DISAGG", default=False, switch=True, only=(False,)),
        Opt(("--load-aware",), "load_aware", "1.6's load-aware preset: not here", env="DYN_ROUTER_LOAD_AWARE",
            default=False, switch=True, only=(False,)),
        *runtime_opts(),
        *tcp_tls_opts(),
    ]


def frontend_refusals() -> list[Refused]:
    return [
        refused("--tls-client-ca-cert-path", "HTTPS client certificates (mutual TLS); --api-key is ours",
                "DYN_TLS_CLIENT_CA_CERT_PATH"),
        refused("--kv-cache-block-size", "the block size comes from the workers' model cards",
                "DYN_KV_CACHE_BLOCK_SIZE"),
        refused("--model-name", "a frontend with a static model; ours serves what workers register",
                "DYN_MODEL_NAME"),
        refused("--model-path", "a frontend with a static model; ours serves what workers register",
                "DYN_MODEL_PATH"),
        refused("--migration-max-seq-len", "a cap on migrated sequences", "DYN_MIGRATION_MAX_SEQ_LEN"),
        refused("--grpc-metrics-port", "the KServe gRPC server", "DYN_GRPC_METRICS_PORT"),
        refused("--frontend-route-extension", "route extensions", "DYN_FRONTEND_ROUTE_EXTENSIONS"),
        refused("--admission-control", "1.6's admission control (ours: --max-inflight, --queue-size)"),
        refused("--router-min-initial-workers", "waiting for N workers before serving",
                "DYN_ROUTER_MIN_INITIAL_WORKERS"),
        refused("--router-session-affinity-ttl-secs", "session affinity", "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS"),
        refused("--router-session-affinity-mode", "session affinity", "DYN_ROUTER_SESSION_AFFINITY_MODE"),
        refused("--active-decode-blocks-threshold", "busy thresholds (ours: the worker's --max-inflight)",
                "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"),
        refused("--active-prefill-tokens-threshold", "busy thresholds (ours: the worker's --max-inflight)",
                "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD"),
        refused("--active-prefill-tokens-threshold-frac", "busy thresholds (ours: the worker's --max-inflight)",
                "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"),
        refused("--router-kv-overlap-score-credit", COST_WHY, "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT"),
        refused("--router-kv-overlap-score-credit-decay", COST_WHY, "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY"),
        refused("--router-prefill-load-scale", COST_WHY, "DYN_ROUTER_PREFILL_LOAD_SCALE"),
        refused("--router-decode-active-request-weight", COST_WHY, "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT"),
        refused("--router-host-cache-hit-weight", COST_WHY, "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"),
        refused("--router-disk-cache-hit-weight", COST_WHY, "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"),
        refused("--router-tracking-hash", "keyed tracking hashes", "DYN_ROUTER_TRACKING_HASH"),
        refused("--router-tracking-key-file", "keyed tracking hashes", "DYN_ROUTER_TRACKING_KEY_FILE"),
        refused("--router-tracking-key-id", "keyed tracking hashes", "DYN_ROUTER_TRACKING_KEY_ID"),
        refused("--router-ttl-secs", "the approximate indexer's TTL is fixed here", "DYN_ROUTER_TTL_SECS"),
        refused("--router-approximate-cache-policy", "the approximate indexer's policy",
                "DYN_ROUTER_APPROXIMATE_CACHE_POLICY"),
        refused("--router-queue-threshold", "router queueing by prefill load (ours: --queue-size, "
                "--queue-timeout)", "DYN_ROUTER_QUEUE_THRESHOLD"),
        refused("--router-queue-policy", "router queue policies", "DYN_ROUTER_QUEUE_POLICY"),
        refused("--router-policy-config", POLICY_WHY, "DYN_ROUTER_POLICY_CONFIG"),
        refused("--router-conditional-disagg-config", POLICY_WHY, "DYN_ROUTER_CONDITIONAL_DISAGG_CONFIG"),
        refused("--router-prefill-policy", POLICY_WHY, "DYN_ROUTER_PREFILL_POLICY"),
        refused("--router-decode-policy", POLICY_WHY, "DYN_ROUTER_DECODE_POLICY"),
        refused("--router-event-threads", "a threaded indexer (ours is one C index)", "DYN_ROUTER_EVENT_THREADS"),
        refused("--shared-cache-multiplier", "an external shared KV cache", "DYN_SHARED_CACHE_MULTIPLIER"),
        refused("--router-predicted-ttl-secs", "predict-on-route", "DYN_ROUTER_PREDICTED_TTL_SECS"),
        refused("--exclude-tools-when-tool-choice-none", "dropping tools from the template on tool_choice none",
                "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", switch=True),
        *ais_refusals(),
    ]


def ais_refusals() -> list[Refused]:
    out = [refused("--ais-perf-config", AIS_WHY)]
    for name in ("backend", "system", "backend-version", "tp-size", "model-path", "moe-tp-size", "moe-ep-size",
                 "attention-dp-size", "nextn", "nextn-accept-rates", "mtp-seed"):
        out.append(refused(f"--ais-{name} --aic-{name}", AIS_WHY))
    return out


def spec() -> Spec:
    return Spec(PROG, "Dynamo 1.x's frontend (HTTP, pre-processor, router) on dynamo-run's: "
                "dynamo-run in=http out=dyn with these flags mapped (docs/cli-1x.md).",
                frontend_opts(), frontend_refusals())


def build(argv: list[str], env: Mapping[str, str] | None = None) -> tuple[RunConfig, dict[str, str]]:
    """argv (and the environment) as the RunConfig of ``dynamo-run in=http|text out=dyn ...``, and the
    variables to set for the runtime."""
    ns, _, env_out = spec().parse(argv, env)
    if bool(ns.tls_cert_path) != bool(ns.tls_key_path):
        raise UserError("--tls-cert-path and --tls-key-path go together")
    cfg = RunConfig(input="text" if ns.interactive else "http", output="dyn", http_host=ns.http_host,
                    http_port=ns.http_port, namespace=ns.namespace, namespace_prefix=ns.namespace_prefix or None,
                    migration_limit=ns.migration_limit,
                    router_mode=ns.router_mode, router_temperature=ns.router_temperature,
                    use_kv_events=ns.use_kv_events, router_replica_sync=ns.router_replica_sync,
                    kv_overlap_score_weight=ns.kv_overlap_score_weight, tls_cert_path=ns.tls_cert_path,
                    tls_key_path=ns.tls_key_path)
    if cfg.input == "http":
        cfg.anthropic_api = ns.enable_anthropic_api
    elif ns.enable_anthropic_api:
        raise UserError("--enable-anthropic-api is for the HTTP server, not --interactive")
    apply_runtime(cfg, ns)
    if ns.dump_config_to:
        dump_config(ns.dump_config_to, PROG, ns, cfg, {"environment_set": env_out})
    return cfg, env_out


def main(argv: list[str] | None = None) -> int:
    return entry(build, argv)
