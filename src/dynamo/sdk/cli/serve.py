"""``dynamo serve MODULE:Service [-f config.yaml] [--Service.key=value ...] [--working-dir DIR] [--dry-run]``.

Import the graph, walk it from the named service (a cycle is refused here, before any process starts),
merge the config (command line > YAML > decorator > the services' own defaults; ``Common`` through
``common-configs``: dynamo.sdk.lib.config), and hand one command per service to the supervisor, which
starts ``ServiceArgs.workers`` replicas of each.  ``--service-name NAME`` (Dynamo 0.x's flag) starts that
one service only: a graph split over machines is one ``dynamo serve`` per service, on the same fleet.  ``--dry-run`` prints the graph, the processes and the
merged config instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace

import yaml

from ..graph import Graph, GraphError, import_root, walk
from ..lib.config import COMMON, ENV_VAR, SERVICE_ARGS, ConfigError, load_yaml, merge_layers, parse_overrides
from ..supervisor import ServiceProcs, Supervisor, child_env

USAGE = ("dynamo serve MODULE:Service [-f config.yaml] [--Service.key=value ...] [--service-name NAME] "
         "[--working-dir DIR] [--dry-run]")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="dynamo serve", usage=USAGE, description=(
        "Start a graph of @service classes, each service as its own processes. Overrides --Service.key=value "
        "(dotted keys nest; --Common.key for shared values) beat the YAML file, which beats the decorators."))
    p.add_argument("target", help="the graph's entry service, MODULE:Service (e.g. graphs.agg:Frontend)")
    p.add_argument("-f", "--file", help="YAML config: a section per service, and Common")
    p.add_argument("--working-dir", help="where MODULE is imported from (default: the current directory)")
    p.add_argument("--service-name", metavar="NAME",
                   help="start only this service of the graph (its replicas); the services it depends on are served "
                        "elsewhere, e.g. by `dynamo serve --service-name` on other machines of the same fleet")
    p.add_argument("--dry-run", action="store_true", help="print the graph, the processes and the config; start nothing")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds a replica has to exit after SIGTERM before it is killed (default 30)")
    return p.parse_known_args(argv)


def build_config(graph: Graph, yaml_path: str | None, overrides: list[str]) -> dict:
    decorators = {spec.name: {SERVICE_ARGS: spec.service_args()} for spec in graph.order}
    yaml_layer = load_yaml(yaml_path) if yaml_path else {}
    return merge_layers([decorators, yaml_layer, parse_overrides(overrides)])


def workers_of(config: dict, name: str) -> int:
    value = ((config.get(name) or {}).get(SERVICE_ARGS) or {}).get("workers", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}.{SERVICE_ARGS}.workers must be an integer >= 1, not {value!r}")
    return value


def plan(graph: Graph, config: dict, target: str, working_dir: str) -> list[ServiceProcs]:
    env = child_env({ENV_VAR: json.dumps(config)})
    out = []
    for spec in graph.order:
        command = [sys.executable, "-m", "dynamo.sdk.runner", target, spec.name, "--working-dir", working_dir]
        out.append(ServiceProcs(spec.name, workers_of(config, spec.name), command, env, cwd=working_dir,
                                depends=list(graph.edges[spec.name])))
    return out


def only(procs: list[ServiceProcs], name: str) -> list[ServiceProcs]:
    """The one service ``--service-name`` names, waiting for nothing: what it depends on runs in other
    ``dynamo serve`` processes (other machines, as a fleet), and its calls wait for their instances
    (sdk/client.py) instead."""
    for p in procs:
        if p.name == name:
            return [replace(p, depends=[])]
    raise GraphError(f"--service-name {name}: no such service in this graph ({', '.join(p.name for p in procs)})")


def dry_run(graph: Graph, procs: list[ServiceProcs], config: dict) -> None:
    print("graph (dependencies first):")
    for spec in graph.order:
        deps = graph.edges[spec.name]
        names = sorted(spec.endpoints())
        print(f"  {spec.name}  namespace={spec.namespace}  endpoints={names or '-'}  apis={sorted(spec.apis()) or '-'}"
              f"  depends on: {', '.join(deps) or '-'}")
    print("processes:")
    for p in procs:
        after = f"  (after {', '.join(p.depends)} ready)" if p.depends else ""
        print(f"  {p.name} x{p.workers}: {' '.join(p.command)} <replica>{after}")
    print("config:")
    print(yaml.safe_dump(config, sort_keys=False).rstrip())


def serve_main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    working_dir = os.path.abspath(args.working_dir or os.getcwd())
    try:
        graph = walk(import_root(args.target, working_dir))
        config = build_config(graph, args.file, overrides)
        procs = plan(graph, config, args.target, working_dir)
        if args.service_name is not None:
            calls = list(graph.edges.get(args.service_name, []))
            procs = only(procs, args.service_name)
    except (GraphError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    known = {spec.name for spec in graph.order} | {COMMON}
    for name in config:
        if name not in known:  # a typo in a section or an override would otherwise change nothing, silently
            print(f"dynamo serve: warning: config section {name!r} names no service of this graph "
                  f"({', '.join(sorted(known))})", file=sys.stderr)
    if args.dry_run:
        dry_run(graph, procs, config)
        return 0
    if args.service_name is not None:
        print(f"dynamo serve: only {args.service_name} here"
              + (f"; it calls {', '.join(calls)}, served elsewhere" if calls else ""), file=sys.stderr)
    return asyncio.run(Supervisor(procs, stop_timeout=args.stop_timeout).run())
