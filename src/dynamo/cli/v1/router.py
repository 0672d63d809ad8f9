"""``python -m dynamo.router --endpoint ns.comp.ep``: Dynamo 1.x's standalone KV router, as a service of its own
(frontend/router_service.py): ``NS.router.best_worker_id`` and ``NS.router.generate`` for the workers at
``ns.comp.ep``.  Its router flags are the frontend's (cli/v1/frontend.py), taken or refused alike."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any, Mapping

from dynamo.cli.v1.common import Opt, Refused, Spec, dump_config, refused, runtime_opts, tcp_tls_opts
from dynamo.cli.v1.frontend import frontend_opts, frontend_refusals
from dynamo.errors import UserError

PROG = "dynamo.router"
ROUTER_DESTS = {"router_temperature", "use_kv_events", "router_replica_sync", "kv_overlap_score_weight",
                "track_active_blocks", "assume_kv_reuse", "track_output_blocks", "track_prefill_tokens",
                "prefill_load_model", "shared_cache_type", "use_remote_indexer", "session_prefix_index",
                "conditional_disagg", "load_aware", "serve_indexer"}
FRONTEND_ONLY = ("--tls-client-ca-cert-path", "--kv-cache-block-size", "--model-name",
                 "--model-path", "--migration-max-seq-len", "--grpc-metrics-port", "--frontend-route-extension",
                 "--admission-control", "--router-min-initial-workers", "--router-session-affinity-ttl-secs",
                 "--router-session-affinity-mode", "--active-decode-blocks-threshold",
                 "--active-prefill-tokens-threshold", "--active-prefill-tokens-threshold-frac",
                 "--exclude-tools-when-tool-choice-none")


def router_opts() -> list[Opt]:
    return [
        Opt(("--endpoint",), "endpoint", "the workers to route to: namespace.component.endpoint (required)",
            env="DYN_ROUTER_ENDPOINT"),
        *[o for o in frontend_opts() if o.dest in ROUTER_DESTS],
        *runtime_opts(),
        *tcp_tls_opts(),
    ]


def router_refusals() -> list[Refused]:
    return [
        refused("--router-block-size --block-size", "the block size comes from the workers' model cards",
                "DYN_ROUTER_BLOCK_SIZE"),
        *[r for r in frontend_refusals() if r.flags[0] not in FRONTEND_ONLY],
    ]


def spec() -> Spec:
    return Spec(PROG, "Dynamo 1.x's standalone KV router: serves NAMESPACE.router.best_worker_id and "
                "NAMESPACE.router.generate for the workers at --endpoint (docs/cli-1x.md).",
                router_opts(), router_refusals())


def parse_endpoint(text: str | None) -> tuple[str, str, str]:
    if not text:
        raise UserError("--endpoint is required (or DYN_ROUTER_ENDPOINT): the workers' namespace.component.endpoint")
    parts = text.removeprefix("dyn://").split(".")
    if len(parts) != 3 or not all(parts):
        raise UserError(f"--endpoint {text!r}: expected namespace.component.endpoint")
    return parts[0], parts[1], parts[2]


def build(argv: list[str], env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    ns, _, env_out = spec().parse(argv, env)
    endpoint = parse_endpoint(ns.endpoint)
    settings = {"endpoint": endpoint, "ns": ns}
    if ns.dump_config_to:
        dump_config(ns.dump_config_to, PROG, ns, None, {"environment_set": env_out})
    return settings, env_out


async def run(settings: dict[str, Any]) -> int:
    from dynamo.frontend.remote import RouterConfig
    from dynamo.frontend.router_service import serve_router
    from dynamo.runtime.distributed import connect_runtime

    ns = settings["ns"]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runtime = await connect_runtime(discovery_backend=ns.discovery_backend, request_plane=ns.request_plane,
                                    event_plane=ns.event_plane)
    config = RouterConfig(mode="kv", kv_overlap_score_weight=ns.kv_overlap_score_weight,
                          router_temperature=ns.router_temperature, use_kv_events=ns.use_kv_events,
                          router_replica_sync=ns.router_replica_sync)
    try:
        return await serve_router(runtime, settings["endpoint"], config, stop)
    finally:
        await runtime.close()


def main(argv: list[str] | None = None) -> int:
    import os

    from dynamo.cli.logs import setup_logging

    args = sys.argv[1:] if argv is None else argv
    try:
        settings, env_out = build(args)
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    os.environ.update(env_out)
    setup_logging(0)
    try:
        import uvloop

        return uvloop.run(run(settings))
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
