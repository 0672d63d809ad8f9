"""Entry points: ``dynamo-run ...`` and ``dynamo run ...``."""

from __future__ import annotations

import faulthandler
import sys

from dynamo.errors import UserError
from dynamo.heap import startup_imports
from dynamo.run_config import RunConfig


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # this module imports little at the top, so that nearly all of start-up's imports run here, with the
    # garbage collector paused (heap.py: passes over modules being imported free nothing)
    with startup_imports():
        from dynamo.cli.flags import build_parser, parse_args

        if not args or all(a in ("-v", "-vv") for a in args):
            build_parser().print_help()
            return 0
        try:
            cfg = parse_args(args)
        except UserError as e:
            print(f"Error: {e}", file=sys.stderr)
            return 2
    return run_parsed(cfg)


def run_parsed(cfg: RunConfig) -> int:
    """Run a parsed and checked :class:`RunConfig` until done or signalled; the exit status.  ``dynamo-run``
    parses argv into one; the Dynamo 1.x entry points (``python -m dynamo.frontend`` ..., cli/v1) build
    theirs from 1.x's flags and come here, so both command lines start the same roles the same way."""
    with startup_imports():
        from dynamo.cli.logs import setup_logging

        setup_logging(cfg.verbosity)
        # a native library that traps while serving (llama.cpp's kernels: the engine's preflight catches
        # the usual case before the first token) leaves "Fatal Python error: Illegal instruction" and the
        # Python stacks, llama_decode's among them, instead of the shell's one word
        faulthandler.enable()
        _import_for(cfg)
    if cfg.http_workers > 1:
        from dynamo.cli.http_workers import supervise

        try:
            return supervise(cfg, lambda: _serve(cfg))
        except UserError as e:
            print(f"Error: {e}", file=sys.stderr)
            return 1
    return _serve(cfg)


def _import_for(cfg: RunConfig) -> None:
    """Import what running ``cfg`` needs first (the rest stays lazy): the launcher, and for ``in=http``
    the HTTP service (aiohttp's server)."""
    import dynamo.cli.launch  # noqa: F401

    if cfg.input_kind == "http":
        import dynamo.frontend.http.service  # noqa: F401


def _serve(cfg: RunConfig) -> int:
    """Run ``cfg`` in this process until done or signalled; the exit status."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows has none
        import asyncio

        runner = asyncio.run  # type: ignore[assignment]  # same call shape as uvloop.run
    from dynamo.cli.launch import run
    from dynamo.runtime import tracing

    try:
        # here, not before a fork (--http-workers): the span exporter's thread is per process
        tracing.init(_service_name(cfg))
        return runner(run(cfg))
    except (UserError, tracing.TracingSetupError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        tracing.shutdown()  # the spans still buffered leave before the process does


def _service_name(cfg: RunConfig) -> str:
    """The traces' service name unless OTEL_SERVICE_NAME says one: the process's role."""
    if cfg.input_kind == "http":
        return "dynamo-frontend"
    if cfg.input_kind == "endpoint":
        return "dynamo-worker"
    return "dynamo-run"


if __name__ == "__main__":
    sys.exit(main())
