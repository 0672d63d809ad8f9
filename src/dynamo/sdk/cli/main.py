"""``dynamo <command>``: ``run`` is ``dynamo-run`` (dynamo.cli), ``serve`` starts a graph (dynamo.sdk), ``build``
writes its Kubernetes manifests.

The umbrella lives in the SDK, the top layer, because ``serve`` needs the SDK and ``run`` needs only the
CLI below it; the CLI package cannot import the SDK.
"""

from __future__ import annotations

import sys

COMMANDS = ("  run    run a model (see 'dynamo run --help')\n  serve  start a graph of services (see 'dynamo serve --help')\n"
            "  build  write Kubernetes manifests for a graph (see 'dynamo build --help')")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: dynamo <command> [args]\n\ncommands:\n" + COMMANDS)
        return 0
    if args[0] == "run":
        from dynamo.cli.main import main as run_main

        return run_main(args[1:])
    if args[0] == "serve":
        from .serve import serve_main

        return serve_main(args[1:])
    if args[0] == "build":
        from .build import build_main

        return build_main(args[1:])
    print(f"Error: unknown command '{args[0]}'. Available: run, serve, build", file=sys.stderr)
    return 2
