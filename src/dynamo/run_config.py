"""What one ``dynamo-run`` process was asked to do: the parsed command line, as one typed record.

It sits below every package (it imports nothing of ours) so that engines, the worker and the frontend
take a ``RunConfig`` rather than ``Any``; :mod:`dynamo.cli.flags` builds it from argv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunConfig:
    input: str = "text"
    output: str | None = None  # None: pick the best installed engine for the model
    model: str | None = None
    model_name: str | None = None
    model_config: str | None = None
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    http_workers: int = 1  # --http-workers: frontend processes on the port
    context_length: int | None = None
    kv_cache_block_size: int | None = None
    tensor_parallel_size: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    leader_addr: str | None = None
    base_gpu_id: int = 0
    extra_engine_args: Path | None = None
    router_mode: str = "round-robin"
    # --kv-overlap-score-weight; None: what the model's workers suggest, else 2.0 (the original: 1.0;
    # docs/routing.md, "Choosing the default overlap weight")
    kv_overlap_score_weight: float | None = None
    router_temperature: float = 0.0
    use_kv_events: bool = True
    router_replica_sync: bool = True  # the original: false (docs/routing.md, "Several frontends")
    migration_limit: int = 0
    max_inflight: int | None = None  # None: worker -> twice the engine's slots, else 512; http -> 1024
    # worker: seconds a shutdown waits for requests in flight before handing them to other workers;
    # None: DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT (30 s)
    drain_timeout: float | None = None
    queue_size: int = 256
    queue_timeout: float = 30.0
    disaggregation_mode: str = "agg"  # worker side: agg, prefill or decode (docs/disaggregation.md)
    max_local_prefill_length: int | None = None  # frontend side; None: the default of disagg/plan.py
    namespace: str | None = None  # frontend side (out=dyn): serve only models registered in this namespace
    # frontend side: serve only models of namespaces whose names start with this (1.x's --namespace-prefix;
    # wins over namespace, as in 1.x)
    namespace_prefix: str | None = None
    batch_concurrency: int = 16
    tool_call_parser: str | None = None  # None: auto (from the chat template)
    reasoning_parser: str | None = None
    verbosity: int = 0
    extra_args: list[str] = field(default_factory=list)
    # the served API and how it is exposed
    chat_template: Path | None = None
    loras: list[tuple[str, str]] = field(default_factory=list)  # --lora NAME=PATH: adapters loaded at start
    mmproj: str | None = None  # --mmproj PATH: out=llamacpp's image projector (llama-server's flag)
    embedding: bool = False
    api_keys: list[str] = field(default_factory=list)
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    anthropic_api: bool | None = None  # --[no-]enable-anthropic-api; None: DYN_ENABLE_ANTHROPIC_API decides
    allowed_local_media_path: str | None = None  # --allowed-local-media-path; None: DYN_MM_LOCAL_PATH decides
    limit_mm_per_prompt: str | None = None  # --limit-mm-per-prompt as given; None: the default limit
    # the distributed runtime (in=dyn://..., out=dyn): "etcd", "file", or None for the default rule
    discovery_backend: str | None = None
    # how this process reaches workers and hears events (None: DYN_REQUEST_PLANE / DYN_EVENT_PLANE, else
    # the runtime's rule: NATS when it answers, else TCP and ZMQ)
    request_plane: str | None = None
    event_plane: str | None = None
    # worker (in=dyn://...): this many workers in this process, each with its own engine and instance id,
    # the first after worker_start_delay seconds, the next worker_stagger seconds apart
    # (``python -m dynamo.mocker --num-workers N --startup-time T --stagger-delay S``)
    num_workers: int = 1
    worker_start_delay: float = 0.0
    worker_stagger: float = 0.0

    @property
    def input_kind(self) -> str:
        if self.input.startswith("batch:"):
            return "batch"
        if self.input.startswith("dyn://"):
            return "endpoint"
        return self.input

    @property
    def engine(self) -> str | None:
        if self.output is None:
            return None
        for prefix in ("pystr:", "pytok:"):
            if self.output.startswith(prefix):
                return prefix[:-1]
        if self.output.startswith("dyn://"):
            return "dyn"
        return self.output
