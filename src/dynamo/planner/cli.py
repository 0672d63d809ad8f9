"""``dynamo-planner`` / ``python -m dynamo.planner``: the command line.

``dynamo-planner [flags]`` runs the planner; ``dynamo-planner profile ...`` profiles one worker
(:mod:`dynamo.planner.profiler`).  Flag names are Dynamo's planner's where it has them.  User errors are
one line on stderr and exit status 2 (flags) or 1 (at run time), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from dynamo.errors import UserError
from dynamo.planner.planner import PlannerConfig

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo-planner", description="Add and remove workers to hold TTFT and ITL "
                                "targets as load changes. `dynamo-planner profile --help` profiles a worker.")
    p.add_argument("--namespace", default="dynamo", help="the fleet's namespace (default: dynamo)")
    p.add_argument("--environment", choices=("local", "virtual"), default="local",
                   help="local: run worker processes here; virtual: write decisions for an outside orchestrator")
    p.add_argument("--adjustment-interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between decisions (default 30)")
    p.add_argument("--ttft", type=float, default=500.0, metavar="MS", help="time-to-first-token target (ms)")
    p.add_argument("--itl", type=float, default=50.0, metavar="MS", help="inter-token latency target (ms)")
    p.add_argument("--min-endpoint", type=int, default=1, metavar="N", help="fewest workers per pool (default 1)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="most workers, prefill and decode together (default: no limit)")
    p.add_argument("--load-predictor", choices=("constant", "arima", "kalman"), default="constant")
    p.add_argument("--profile-results-dir", type=Path, default=None, metavar="DIR",
                   help="a `dynamo-planner profile` output; without it the capacity is learned online")
    p.add_argument("--no-operation", action="store_true", help="log and export decisions, change nothing")
    p.add_argument("--frontend-url", action="append", default=[], metavar="URL",
                   help="a frontend to read the load from (repeatable), e.g. http://127.0.0.1:8000; without it, "
                        "the frontends registered in discovery")
    p.add_argument("--model", default=None, help="only this model's load (default: every model the frontends serve)")
    p.add_argument("--decode-cmd", default=None, metavar="CMD",
                   help='local: the command of one (decode or aggregated) worker, e.g. "dynamo-run in=dyn://'
                        'dynamo.backend.generate out=mocker MODEL"')
    p.add_argument("--prefill-cmd", default=None, metavar="CMD",
                   help="local: the command of one prefill worker (a disaggregated fleet)")
    p.add_argument("--prefill-component", default=None,
                   help="virtual: the prefill workers' component (a disaggregated fleet); default: aggregated")
    p.add_argument("--decode-component", default="backend", help="virtual: the decode workers' component")
    p.add_argument("--scale-down-after", type=int, default=3, metavar="K",
                   help="scale down only after K intervals in a row wanted fewer workers (default 3)")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="local: kill a draining worker still running after this long (default 60)")
    p.add_argument("--stop-workers-on-exit", action="store_true",
                   help="local: drain the workers when the planner exits (default: leave them for the next planner)")
    p.add_argument("--state-dir", type=Path, default=Path(".dynamo-planner"), metavar="DIR",
                   help="local: where the fleet's state file is kept (default .dynamo-planner)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="local: the workers' log files (default <state-dir>/logs)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve the dynamo_planner_* metrics on this port (0: any free port, logged)")
    p.add_argument("--discovery-backend", choices=("etcd", "kv_store", "file"), default=None,
                   help="where the fleet registers: etcd (kv_store is the same) or file (one host); default "
                        "DYN_DISCOVERY_BACKEND, else etcd when ETCD_ENDPOINTS is set or etcd answers, else file")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v debug, -vv trace")
    return p


def config_from(args: argparse.Namespace) -> PlannerConfig:
    if args.adjustment_interval <= 0:
        raise UserError("--adjustment-interval must be positive")
    if args.ttft <= 0 or args.itl <= 0:
        raise UserError("--ttft and --itl must be positive")
    if args.min_endpoint < 0:
        raise UserError("--min-endpoint must be 0 or more")
    if args.max_workers is not None and args.max_workers < 1:
        raise UserError("--max-workers must be 1 or more")
    if args.environment == "local" and not args.decode_cmd:
        raise UserError("--environment local needs --decode-cmd (the command that starts one worker)")
    if args.environment == "virtual" and (args.decode_cmd or args.prefill_cmd):
        raise UserError("--decode-cmd and --prefill-cmd are for --environment local")
    for url in args.frontend_url:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--frontend-url {url}: not an http:// or https:// URL")
    if args.profile_results_dir is not None and not args.profile_results_dir.is_dir():
        raise UserError(f"--profile-results-dir {args.profile_results_dir}: no such directory")
    return PlannerConfig(
        namespace=args.namespace, environment=args.environment, adjustment_interval=args.adjustment_interval,
        ttft_ms=args.ttft, itl_ms=args.itl, min_endpoint=args.min_endpoint, max_workers=args.max_workers,
        load_predictor=args.load_predictor, profile_results_dir=args.profile_results_dir,
        no_operation=args.no_operation, frontend_urls=list(args.frontend_url), decode_cmd=args.decode_cmd,
        prefill_cmd=args.prefill_cmd, model=args.model, metrics_port=args.metrics_port,
        scale_down_after=args.scale_down_after, prefill_component=args.prefill_component,
        decode_component=args.decode_component, state_dir=args.state_dir,
        log_dir=args.log_dir or args.state_dir / "logs", drain_timeout=args.drain_timeout,
        stop_workers_on_exit=args.stop_workers_on_exit,
        discovery_backend={"kv_store": "etcd"}.get(args.discovery_backend, args.discovery_backend))


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["profile"]:
        from dynamo.planner.profiler import main as profile_main

        return profile_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    from dynamo.cli.logs import setup_logging

    setup_logging(args.verbose)
    try:
        cfg = config_from(args)
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(cfg))
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def run(cfg: PlannerConfig) -> int:
    """Run the planner until SIGINT or SIGTERM."""
    from dynamo.planner.frontends import FrontendDirectory, NamespaceModels
    from dynamo.planner.metrics import PlannerMetrics
    from dynamo.planner.observe import FrontendScraper
    from dynamo.planner.planner import Planner
    from dynamo.runtime.distributed import connect_runtime

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    capacity = None
    if cfg.profile_results_dir is not None:
        from dynamo.planner.profile_capacity import ProfileCapacity

        capacity = ProfileCapacity.load(cfg.profile_results_dir)
    metrics = PlannerMetrics()
    if cfg.metrics_port is not None:
        try:
            bound = metrics.serve(cfg.metrics_port)
            log.info("planner metrics on http://0.0.0.0:%d/metrics", bound)
        except OSError as e:
            raise UserError(f"--metrics-port {cfg.metrics_port}: {e.strerror or e}") from None
    # discovery: the frontends registered there, the namespace's models, and the virtual connector's keys
    try:
        runtime = await connect_runtime(discovery_backend=cfg.discovery_backend)
    except BaseException:
        metrics.close()
        raise
    store = runtime.discovery()
    connector: Any
    if cfg.environment == "virtual":
        from dynamo.planner.virtual_connector import VirtualConnector

        connector = VirtualConnector(store, cfg.namespace, cfg.prefill_component, cfg.decode_component)
    else:
        from dynamo.planner.local_connector import LocalConnector

        assert cfg.decode_cmd is not None
        connector = LocalConnector(cfg.namespace, cfg.decode_cmd, cfg.prefill_cmd, cfg.state_dir, cfg.log_dir,
                                   cfg.drain_timeout, cfg.stop_workers_on_exit)
    frontends = FrontendDirectory(store, cfg.frontend_urls)

    scraper = FrontendScraper(frontends.urls, models=NamespaceModels(store, cfg.namespace, cfg.model))
    try:
        await frontends.start()
        await Planner(cfg, connector, scraper, capacity, metrics).run(stop)
    finally:
        await connector.close()
        await scraper.close()
        await frontends.close()
        metrics.close()
        await runtime.close()
    return 0
