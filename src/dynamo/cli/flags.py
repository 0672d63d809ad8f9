"""Command-line grammar of dynamo-run: ``in=`` / ``out=`` anywhere, one positional model, long flags.

The original only looks at the first two arguments for in=/out= and skips flags by position; we use a
normal parser (decisions.md): in=/out= may appear anywhere, unknown flags are errors, ``--`` ends the
flags (what follows goes to Python engines).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, TypeVar

from dynamo.engines.engine_args import check_engine_args
from dynamo.errors import UserError
from dynamo.llm.parsers.registry import reasoning_parser_names, tool_call_parser_names
from dynamo.run_config import RunConfig

ENGINES = [
    "echo_full", "echo_core", "mocker", "llamacpp", "mistralrs", "vllm", "sglang", "trtllm",
    "pystr:<engine.py>", "pytok:<engine.py>", "dyn",
]
ENGINE_ALIASES = {"llama_cpp": "llamacpp", "auto": "dyn"}
ROUTER_MODES = ("round-robin", "random", "kv")
MAX_HTTP_WORKERS = 64
# engines cheap enough to run once per HTTP worker process (--http-workers): the others would load the model N times
HTTP_WORKER_ENGINES = ("dyn", "echo_full", "echo_core")
DISAGG_MODES = ("agg", "prefill", "decode")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("nats", "zmq")
# engines that can serve --disaggregation-mode prefill/decode (others: a clear error, never ignored)
DISAGG_ENGINES = ("llamacpp", "mocker", "vllm")

USAGE = (
    "dynamo-run [in=text|stdin|http|batch:<file.jsonl>|dyn://<namespace.component.endpoint>|none] "
    "[out=echo_full|echo_core|mocker|llamacpp|mistralrs|vllm|sglang|trtllm|pystr:<file.py>|pytok:<file.py>|dyn] "
    "[<model>] [--http-port 8080] [--http-host 0.0.0.0] [--http-workers 1] [--model-path <path>] [--model-name <name>] "
    "[--model-config <hf folder>] [--context-length N] [--kv-cache-block-size 16] "
    "[--tensor-parallel-size 1] [--num-nodes 1] [--node-rank 0] [--leader-addr host:port] "
    "[--base-gpu-id 0] [--extra-engine-args args.json] [--router-mode round-robin|random|kv] "
    "[--kv-overlap-score-weight W] [--router-temperature 0.0] [--use-kv-events true|false] [--router-replica-sync true|false] "
    "[--migration-limit 0] [--max-inflight N] [--drain-timeout 30] [--queue-size 256] [--queue-timeout 30] "
    "[--disaggregation-mode agg|prefill|decode] [--max-local-prefill-length 128] [--namespace NS] "
    "[--request-plane tcp|nats] [--event-plane nats|zmq] "
    "[--tool-call-parser auto|none|NAME] [--reasoning-parser auto|none|NAME] "
    "[--chat-template <file.jinja>] [--embedding] [--mmproj <mmproj.gguf>] [--api-key KEY] "
    "[--tls-cert-path cert.pem --tls-key-path key.pem] [--allowed-origins <origin>] "
    "[--discovery-backend etcd|file] [-v|-vv] "
    "[-- <python engine args>]"
)

DESCRIPTION = """\
Serve a large language model with one command.

inputs (in=):
  text                 interactive chat in the terminal (the default when stdin is a terminal)
  stdin                read all of stdin as one prompt, print the answer, exit (default when piped)
  http                 OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions,
                       /v1/embeddings, /v1/responses (GET/DELETE /v1/responses/ID, .../input_items),
                       /v1/models, /tokenize, /detokenize, /tokenizer_info, /health, /live, /metrics
  batch:FILE.jsonl     run every {"text": ...} line of FILE, write output.jsonl beside it
  dyn://ns.comp.ep     serve the engine as a worker on the distributed runtime (etcd + NATS);
                       missing parts are defaulted (dyn://test)
  none                 start the engine and serve nothing (multi-node followers)

engines (out=):
  echo_full            echoes the last user message, a character per chunk (no model needed)
  echo_core            echoes the templated prompt's tokens (needs a model folder for the tokenizer)
  mocker               a simulated vLLM worker with KV cache events (for routing tests)
  llamacpp             llama.cpp via llama-cpp-python (GGUF files), continuous batching on CPU/GPU
  mistralrs            mistral.rs (GGUF files and HF folders)
  vllm, sglang, trtllm the Python engines of those projects
  pystr:FILE.py        your own Python engine taking OpenAI requests, yielding chunks
  pytok:FILE.py        your own Python engine taking token ids, yielding token ids
  dyn                  remote workers found through etcd (run workers with in=dyn://...)

model: a Hugging Face repo id (downloaded, e.g. Qwen/Qwen3-0.6B or hf://Qwen/Qwen3-0.6B), a local Hugging
Face folder, or a GGUF file.  The served name is --model-name, else the repo id, folder or file name.

environment: DYN_LOG (like RUST_LOG: "debug", "info,dynamo.llm=debug"), DYN_TOKEN_ECHO_DELAY_MS (echo
engines, default 10), HF_TOKEN, HF_HUB_OFFLINE, ETCD_ENDPOINTS, NATS_SERVER, DYN_STREAM_LIVENESS_S
(seconds a worker may send nothing, not even a heartbeat, before its streams count as dead and it gets
no new requests until it answers again; default 5); in=http: DYN_API_KEY (keys separated by commas;
--api-key replaces it), DYN_HTTP_BODY_LIMIT_MB (default 32), DYN_RESPONSES_STORE_SIZE (responses kept
for previous_response_id and GET /v1/responses/ID, default 1000).

metrics: in=http serves /metrics (dynamo_frontend_*; DYN_METRICS_PREFIX renames them).  A worker
(in=dyn://...) serves /health, /live and /metrics (dynamo_component_*) with DYN_SYSTEM_ENABLED=true or
DYN_SYSTEM_PORT set (default port 8081, 0 = any free port, -1 = off; DYN_SYSTEM_HOST, default 127.0.0.1
when the planes listen on loopback (one machine), else 0.0.0.0;
DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS='["generate"]'; DYN_SYSTEM_HEALTH_PATH, DYN_SYSTEM_LIVE_PATH).

overload: a worker takes at most --max-inflight requests at once (default: twice the engine's slots,
mocker max_num_seqs, llamacpp n_parallel: as many queued as running; else 512) and tells frontends;
a frontend takes at most --max-inflight requests in all (default 1024), queues up to --queue-size
requests while every worker is full, each for up to --queue-timeout seconds, and answers the rest 503
with Retry-After.

examples:
  dynamo-run in=http out=echo_full --model-name demo
  dynamo-run in=text out=llamacpp ./SmolLM2-135M-Instruct.Q4_1.gguf
  dynamo-run in=dyn://llama.backend.generate out=llamacpp model.gguf   # worker
  dynamo-run in=http out=dyn --router-mode kv                          # frontend
  dynamo-run in=http out=llamacpp model.gguf --embedding               # /v1/embeddings
  dynamo-run in=http out=llamacpp model.gguf --api-key $KEY --tls-cert-path cert.pem --tls-key-path key.pem
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message}. Run 'dynamo-run --help' for usage.")


_Number = TypeVar("_Number", int, float)


def _bounded(name: str, parse: Callable[[str], _Number], kind: str, lo: _Number | None,
             hi: _Number | None) -> Callable[[str], _Number]:
    """An argparse ``type=`` converter: ``parse`` the text, then check ``lo <= value <= hi`` (None: no bound).

    Our own messages name the flag and what it accepts ("--num-nodes must be at least 1, got 0");
    argparse's would only say "invalid conv value".
    """
    def conv(text: str) -> _Number:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {kind}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return conv


def _int(name: str, lo: int = 1, hi: int | None = None) -> Callable[[str], int]:
    """An integer flag, at least ``lo`` (1 unless said) and at most ``hi``."""
    return _bounded(name, int, "an integer", lo, hi)


def _float(name: str, lo: float | None = None) -> Callable[[str], float]:
    """A number flag, at least ``lo`` when given."""
    return _bounded(name, float, "a number", lo, None)


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dynamo-run",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
        allow_abbrev=False,
    )
    p.add_argument("model", nargs="?", help="HF repo id, HF folder or GGUF file (same as --model-path)")
    p.add_argument("--model-path", help="the model, if not given as the positional argument")
    p.add_argument("--model-name", help="the name clients use for the model (default: repo id, folder or file name)")
    p.add_argument("--model-config", help="HF folder to take the tokenizer, template and config from (e.g. for a GGUF)")
    p.add_argument("--http-host", default="0.0.0.0", help="address for in=http to listen on (default 0.0.0.0)")
    p.add_argument("--http-port", type=_int("--http-port", 0, 65535), default=8080, help="port for in=http (default 8080)")
    p.add_argument("--http-workers", "--api-server-count", type=_int("--http-workers", 1, MAX_HTTP_WORKERS), default=1,
                   dest="http_workers", metavar="N",
                   help="in=http: N frontend processes sharing the port (out=dyn, echo_full, echo_core; default 1)")
    p.add_argument("--context-length", type=_int("--context-length"), help="override the model's context length (worker side)")
    p.add_argument("--kv-cache-block-size", type=_int("--kv-cache-block-size"), help="KV cache block size in tokens (default 16; worker side)")
    p.add_argument("--tensor-parallel-size", type=_int("--tensor-parallel-size", 1, 256), default=1, help="GPUs per model instance (vllm/sglang/trtllm)")
    p.add_argument("--num-nodes", type=_int("--num-nodes"), default=1, help="nodes in a multi-node engine (sglang/vllm/trtllm)")
    p.add_argument("--node-rank", type=_int("--node-rank", 0), default=0, help="this node's rank in a multi-node engine")
    p.add_argument("--leader-addr", help="host:port of the multi-node leader (rank 0)")
    p.add_argument("--base-gpu-id", type=_int("--base-gpu-id", 0), default=0, help="first GPU to use (sglang)")
    p.add_argument("--extra-engine-args", help="JSON (YAML for trtllm) file merged into the engine's arguments")
    p.add_argument("--router-mode", choices=ROUTER_MODES, default="round-robin", help="how out=dyn picks a worker (default round-robin)")
    p.add_argument("--kv-overlap-score-weight", type=_float("--kv-overlap-score-weight", 0.0), default=None, help="KV router: weight of prefill cost vs decode load (default: what the workers' engine suggests, 6.0 for llamacpp, else 2.0)")
    p.add_argument("--router-temperature", type=_float("--router-temperature", 0.0), default=0.0, help="KV router: softmax temperature, 0 picks the best worker (default 0.0)")
    p.add_argument("--use-kv-events", type=_bool, default=True, metavar="true|false", help="KV router: follow workers' KV events (true) or predict the cache (false)")
    p.add_argument("--router-replica-sync", type=_bool, default=True, metavar="true|false", help="KV router: share in-flight requests with the other frontends of the same workers over the event plane (default true; the original's default is false)")
    p.add_argument("--migration-limit", type=_int("--migration-limit", 0, 1024), default=0, help="times a request may move to another worker when one dies or freezes (on a worker or the frontend; the larger applies; default 0)")
    p.add_argument("--max-inflight", type=_int("--max-inflight"), help="worker: requests served at once, more are refused as busy (default: twice the engine's slots, as many queued in the engine as it runs; else 512); in=http: requests in progress in all, more get 503 (default 1024)")
    p.add_argument("--drain-timeout", type=_float("--drain-timeout", 0.0), metavar="SECONDS", help="worker: on SIGTERM it deregisters, stops taking requests and lets those in flight finish for this long, then hands the rest to other workers (default: DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT, 30)")
    p.add_argument("--queue-size", type=_int("--queue-size", 0), help="out=dyn: requests that may wait while every worker is full; more get 503 (default 256)")
    p.add_argument("--queue-timeout", type=_float("--queue-timeout", 0.0), help="out=dyn: seconds a request may wait for a worker with room before its 503 (default 30)")
    p.add_argument("--disaggregation-mode", choices=DISAGG_MODES, default="agg", help="worker side: agg prefills and decodes (default), prefill only prefills and hands the KV state to a decode worker, decode decodes (and prefills when no prefill worker did)")
    p.add_argument("--namespace", metavar="NS", help="out=dyn: serve only the models registered in this dynamo "
                   "namespace (default: every namespace), e.g. a processor's and not the workers behind it")
    p.add_argument("--max-local-prefill-length", type=_int("--max-local-prefill-length", 0), help="frontend side: prompts with at most this many tokens not cached on the decode worker are prefilled there, not on a prefill worker (default 128)")
    p.add_argument("--tool-call-parser", metavar="NAME", help="how to read tool calls from the model's text: "
                   + ", ".join(tool_call_parser_names()) + " (default auto: from the chat template; worker side)")
    p.add_argument("--reasoning-parser", metavar="NAME", help="how to split reasoning from the answer: "
                   + ", ".join(reasoning_parser_names()) + " (default auto: from the chat template; worker side)")
    p.add_argument("--batch-concurrency", type=_int("--batch-concurrency"), default=16, help="in=batch: prompts in flight at once (default 16)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template file replacing the model's (local engine or worker; travels in the model card)")
    p.add_argument("--lora", action="append", dest="loras", metavar="NAME=PATH", help="serve the LoRA adapter at PATH as the model NAME: a GGUF file (out=llamacpp) or a PEFT folder (out=vllm); repeatable")
    p.add_argument("--mmproj", metavar="PATH", help="out=llamacpp: the model's image projector (an mmproj GGUF, as llama-server's --mmproj): chat requests may then carry images")
    p.add_argument("--embedding", action="store_true", help="serve the model for /v1/embeddings (out=llamacpp, out=vllm, out=echo_core) instead of generation")
    p.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY", help="in=http: require 'Authorization: Bearer KEY' on every route but /health, /live, /metrics (repeat for several keys; default: DYN_API_KEY)")
    p.add_argument("--tls-cert-path", metavar="PEM", help="in=http: serve HTTPS with this certificate (chain) file")
    p.add_argument("--tls-key-path", metavar="PEM", help="in=http: the private key of --tls-cert-path")
    p.add_argument("--allowed-origins", action="append", metavar="ORIGINS", help="in=http: CORS origins allowed to call the API ('https://app.example.com', comma-separated, repeatable, or '*'; default none)")
    p.add_argument("--enable-anthropic-api", action=argparse.BooleanOptionalAction, default=None,
                   dest="anthropic_api", help="in=http: serve Anthropic's Messages API, /v1/messages and "
                   "/v1/messages/count_tokens (default: DYN_ENABLE_ANTHROPIC_API, else off)")
    p.add_argument("--allowed-local-media-path", metavar="DIR", help="in=http: allow file:// image URLs under "
                   "this directory (default: DYN_MM_LOCAL_PATH, else no local files)")
    p.add_argument("--limit-mm-per-prompt", metavar="LIMITS", help="in=http: the most images one request may carry, "
                   "'{\"image\": N}' or image=N (default 16)")
    p.add_argument("--discovery-backend", choices=("etcd", "kv_store", "file"), help="in=dyn://... and out=dyn: where processes find each other: etcd (kv_store is the same), or file (a directory shared by the processes of one host, DYN_FILE_KV); default DYN_DISCOVERY_BACKEND, else etcd when ETCD_ENDPOINTS is set or etcd answers on localhost:2379, else file")
    p.add_argument("--request-plane", choices=REQUEST_PLANES, help="how requests reach workers: tcp (each worker listens; "
                   "no NATS) or nats (default: DYN_REQUEST_PLANE, else nats when NATS_SERVER is set or a NATS answers on "
                   "localhost:4222, else tcp)")
    p.add_argument("--event-plane", choices=EVENT_PLANES, help="how KV events and load metrics travel: zmq (no NATS) "
                   "or nats (default: DYN_EVENT_PLANE, else nats when NATS_SERVER is set or a NATS answers on localhost:4222, "
                   "else zmq)")
    p.add_argument("-v", "--verbose", action="count", default=0, dest="verbosity", help="-v debug logs, -vv trace logs (default info)")
    p.add_argument("--version", action=_VersionAction)
    return p


class _VersionAction(argparse.Action):
    """``--version``; looks the version up only when asked (importlib.metadata costs start-up time)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(f"dynamo-run {_version()}")
        parser.exit()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("dynamo-run-py")
    except Exception:
        return "unknown"


VALID_INPUTS = ("text", "stdin", "http", "none")


def parse_lora_flags(values: list[str]) -> list[tuple[str, str]]:
    """``--lora name=path`` (repeatable) as (name, path) pairs; UserError for a malformed one."""
    out: list[tuple[str, str]] = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora {value!r}: expected NAME=PATH (the adapter's model name and its file or folder)")
        if name in {n for n, _ in out}:
            raise UserError(f"--lora: adapter name {name!r} is given twice")
        out.append((name, path))
    return out


def parse_args(argv: list[str], *, stdin_is_tty: bool | None = None) -> RunConfig:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    inp = out = None
    rest: list[str] = []
    for arg in argv:
        if arg.startswith("in="):
            if inp is not None:
                raise UserError("in= given twice")
            inp = arg[3:]
        elif arg.startswith("out="):
            if out is not None:
                raise UserError("out= given twice")
            out = arg[4:]
        else:
            rest.append(arg)
    ns = build_parser().parse_args(rest)
    if ns.verbosity > 2:
        raise UserError("Invalid verbosity level. Valid values are -v (debug) or -vv (trace)")

    if inp is None:
        tty = sys.stdin.isatty() if stdin_is_tty is None else stdin_is_tty
        inp = "text" if tty else "stdin"
    _check_input(inp)
    if out is not None:
        out = ENGINE_ALIASES.get(out, out)
        _check_output(out)

    if (ns.queue_size is not None or ns.queue_timeout is not None) and out not in ("dyn", None) \
            and not (out or "").startswith("dyn://"):
        raise UserError("--queue-size and --queue-timeout apply to a frontend of workers (out=dyn)")
    model = ns.model or ns.model_path
    if ns.model and ns.model_path and ns.model != ns.model_path:
        raise UserError(f"the model is given twice: {ns.model!r} and --model-path {ns.model_path!r}")
    cfg = RunConfig(
        input=inp,
        output=out,
        model=model,
        model_name=ns.model_name,
        model_config=ns.model_config,
        http_host=ns.http_host,
        http_port=ns.http_port,
        http_workers=ns.http_workers,
        context_length=ns.context_length,
        kv_cache_block_size=ns.kv_cache_block_size,
        tensor_parallel_size=ns.tensor_parallel_size,
        num_nodes=ns.num_nodes,
        node_rank=ns.node_rank,
        leader_addr=ns.leader_addr,
        base_gpu_id=ns.base_gpu_id,
        extra_engine_args=Path(ns.extra_engine_args) if ns.extra_engine_args else None,
        router_mode=ns.router_mode,
        kv_overlap_score_weight=ns.kv_overlap_score_weight,
        router_temperature=ns.router_temperature,
        use_kv_events=ns.use_kv_events,
        router_replica_sync=ns.router_replica_sync,
        migration_limit=ns.migration_limit,
        max_inflight=ns.max_inflight,
        drain_timeout=ns.drain_timeout,
        queue_size=ns.queue_size if ns.queue_size is not None else 256,
        queue_timeout=ns.queue_timeout if ns.queue_timeout is not None else 30.0,
        disaggregation_mode=ns.disaggregation_mode,
        max_local_prefill_length=ns.max_local_prefill_length,
        namespace=ns.namespace,
        batch_concurrency=ns.batch_concurrency,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        verbosity=ns.verbosity,
        extra_args=extra,
        chat_template=Path(ns.chat_template).expanduser() if ns.chat_template else None,
        embedding=ns.embedding,
        loras=parse_lora_flags(ns.loras or []),
        mmproj=ns.mmproj,
        api_keys=ns.api_keys or [],
        tls_cert_path=ns.tls_cert_path,
        tls_key_path=ns.tls_key_path,
        allowed_origins=ns.allowed_origins or [],
        anthropic_api=ns.anthropic_api,
        allowed_local_media_path=ns.allowed_local_media_path,
        limit_mm_per_prompt=ns.limit_mm_per_prompt,
        discovery_backend={"kv_store": "etcd"}.get(ns.discovery_backend, ns.discovery_backend),
        request_plane=ns.request_plane,
        event_plane=ns.event_plane,
    )
    validate(cfg)
    return cfg


def _check_input(inp: str) -> None:
    if inp in VALID_INPUTS:
        return
    if inp.startswith("batch:"):
        if not inp[6:]:
            raise UserError("in=batch: needs a file: in=batch:prompts.jsonl")
        return
    if inp.startswith("dyn://"):
        return
    raise UserError(
        f"Invalid in= option '{inp}'. Valid: text, stdin, http, batch:<file.jsonl>, dyn://<ns.comp.ep>, none"
    )


def _check_output(out: str) -> None:
    if out.startswith(("pystr:", "pytok:")):
        if not out.split(":", 1)[1]:
            raise UserError(f"out={out} needs a Python file: out={out}my_engine.py")
        return
    if out.startswith("dyn://") or out in ENGINES:
        return
    names = ", ".join(ENGINES)
    raise UserError(f"Invalid out= option '{out}'. Valid: {names}")


def validate(cfg: RunConfig) -> None:
    """Combinations that cannot work, caught before anything is loaded."""
    if cfg.input_kind == "endpoint" and cfg.engine == "dyn":
        raise UserError("Cannot use endpoint for both in and out")
    if cfg.engine == "dyn":
        for flag, value in (("--context-length", cfg.context_length),
                            ("--kv-cache-block-size", cfg.kv_cache_block_size),
                            ("--tool-call-parser", cfg.tool_call_parser),
                            ("--reasoning-parser", cfg.reasoning_parser)):
            if value is not None:
                raise UserError(f"'{flag}' flag should only be used on the worker node, not on the ingress")
    if cfg.max_inflight is not None and cfg.input_kind not in ("endpoint", "http"):
        raise UserError("--max-inflight applies to a worker (in=dyn://...) or to in=http")
    if cfg.drain_timeout is not None and cfg.input_kind != "endpoint":
        raise UserError("--drain-timeout applies to a worker (in=dyn://...)")
    if cfg.disaggregation_mode != "agg":
        if cfg.input_kind != "endpoint":
            raise UserError(f"--disaggregation-mode {cfg.disaggregation_mode} is for workers: use it with "
                            "in=dyn://namespace.component.endpoint")
        if cfg.engine not in DISAGG_ENGINES:
            raise UserError(f"--disaggregation-mode {cfg.disaggregation_mode}: out={cfg.output} cannot hand KV state "
                            f"between workers; engines that can: {', '.join(DISAGG_ENGINES)}")
    for flag, value in (("--discovery-backend", cfg.discovery_backend), ("--request-plane", cfg.request_plane),
                        ("--event-plane", cfg.event_plane)):
        if value is not None and cfg.input_kind != "endpoint" and cfg.engine != "dyn":
            raise UserError(f"{flag} is for the distributed runtime: use it with in=dyn://... or out=dyn")
    if cfg.namespace is not None and cfg.engine != "dyn":
        raise UserError("'--namespace' is a frontend flag: use it with out=dyn")
    if cfg.namespace is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.namespace):
        raise UserError(f"--namespace {cfg.namespace!r}: letters, digits, '_' and '-' only")
    if cfg.max_local_prefill_length is not None and cfg.engine != "dyn":
        raise UserError("'--max-local-prefill-length' is a frontend flag: use it with out=dyn")
    for flag, value, names in (("--tool-call-parser", cfg.tool_call_parser, tool_call_parser_names()),
                               ("--reasoning-parser", cfg.reasoning_parser, reasoning_parser_names())):
        if value is not None and value not in names:
            raise UserError(f"{flag} {value!r} is not a known parser. Valid: {', '.join(names)}")
    if cfg.engine == "mocker" and cfg.input_kind != "endpoint":
        raise UserError("out=mocker simulates a distributed worker: use it with in=dyn://namespace.component.endpoint")
    if cfg.node_rank >= cfg.num_nodes:
        raise UserError(f"--node-rank {cfg.node_rank} must be less than --num-nodes {cfg.num_nodes}")
    if cfg.num_nodes > 1 and not cfg.leader_addr:
        raise UserError("--num-nodes > 1 needs --leader-addr host:port (the rank 0 node)")
    check_engine_args(cfg)
    if cfg.http_workers > 1:
        if cfg.input_kind != "http":
            raise UserError(f"--http-workers runs several HTTP frontends: it needs in=http, not in={cfg.input}")
        if cfg.engine not in HTTP_WORKER_ENGINES:
            raise UserError(
                f"--http-workers {cfg.http_workers} would load the model {cfg.http_workers} times; it works with "
                "out=dyn (run the engine as a worker: in=dyn://ns.comp.ep) and the echo engines"
            )
    if cfg.input_kind == "batch":
        path = Path(cfg.input[6:])
        if not path.is_file():
            raise UserError(f"Missing or not a file: {path}. in=batch: needs a JSON Lines file.")
    _validate_api(cfg)
    if cfg.engine in ("pystr", "pytok"):
        file = Path(cfg.output.split(":", 1)[1])  # type: ignore[union-attr]
        if not file.is_file():
            raise UserError(f"out={cfg.output}: no such Python file: {file}")


def _validate_api(cfg: RunConfig) -> None:
    """--chat-template, --embedding and the HTTP exposure flags."""
    http_flags = [name for name, value in (("--api-key", cfg.api_keys), ("--tls-cert-path", cfg.tls_cert_path),
                                            ("--tls-key-path", cfg.tls_key_path),
                                            ("--allowed-origins", cfg.allowed_origins),
                                            ("--enable-anthropic-api", cfg.anthropic_api),
                                            ("--allowed-local-media-path", cfg.allowed_local_media_path),
                                            ("--limit-mm-per-prompt", cfg.limit_mm_per_prompt)) if value]
    if http_flags and cfg.input_kind != "http":
        raise UserError(f"{', '.join(http_flags)}: only for in=http (the HTTP server), not in={cfg.input}")
    if cfg.input_kind == "http":
        from dynamo.frontend.http.options import build_http_options

        build_http_options(api_keys=cfg.api_keys, allowed_origins=cfg.allowed_origins,
                           tls_cert_path=cfg.tls_cert_path, tls_key_path=cfg.tls_key_path,
                           anthropic_api=cfg.anthropic_api,
                           allowed_local_media_path=cfg.allowed_local_media_path,
                           limit_mm_per_prompt=cfg.limit_mm_per_prompt)
    if cfg.chat_template is not None:
        if cfg.engine == "dyn":
            raise UserError("--chat-template goes on the worker (in=dyn://...): the frontend uses the template "
                            "in the worker's model card")
        if not cfg.chat_template.is_file():
            raise UserError(f"--chat-template: no such file: {cfg.chat_template}")
    if cfg.embedding:
        if cfg.engine == "dyn":
            raise UserError("--embedding goes on the worker (in=dyn://...): the frontend serves what workers register")
        if cfg.input_kind not in ("http", "endpoint"):
            raise UserError(f"--embedding serves /v1/embeddings: use it with in=http or in=dyn://..., not in={cfg.input}")
