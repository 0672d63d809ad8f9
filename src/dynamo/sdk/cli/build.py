"""``dynamo build MODULE:Service [-f config.yaml] [--Service.key=value ...] --kubernetes DIR``.

The graph and its config as ``dynamo serve`` reads them (same walk, same merge, same errors), written as
Kubernetes manifests (dynamo.sdk.lib.kubernetes) instead of started.  Only manifests are built here: the
original's ``dynamo build`` also packed the graph into a container image, which needs a container
builder this project does not drive; the image is named with ``--image`` or each service's ``image``.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from ..graph import GraphError, import_root, walk
from ..lib.config import ConfigError
from ..lib.kubernetes import manifests
from .serve import build_config, workers_of

USAGE = ("dynamo build MODULE:Service [-f config.yaml] [--Service.key=value ...] --kubernetes DIR [--image IMAGE] "
         "[--name NAME] [--etcd-endpoints URL] [--nats-server URL] [--image-workdir DIR] [--working-dir DIR]")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="dynamo build", usage=USAGE, description=(
        "Write Kubernetes manifests for a graph: a Deployment and a Service per service, the merged config "
        "as a ConfigMap. Config and overrides as for 'dynamo serve'."))
    p.add_argument("target", help="the graph's entry service, MODULE:Service (e.g. graphs.agg:Frontend)")
    p.add_argument("-f", "--file", help="YAML config: a section per service, and Common")
    p.add_argument("--kubernetes", metavar="DIR", help="write the manifests into DIR (created if missing)")
    p.add_argument("--image", help="container image of every service that names none itself (ServiceArgs.image)")
    p.add_argument("--name", help="the graph's name, the prefix of every object (default: the module's last part)")
    p.add_argument("--etcd-endpoints", default="http://etcd:2379", help="the cluster's etcd (default http://etcd:2379)")
    p.add_argument("--nats-server", default="nats://nats:4222", help="the cluster's NATS (default nats://nats:4222)")
    p.add_argument("--image-workdir", default="/workspace",
                   help="where the graph's MODULE lies inside the image (default /workspace)")
    p.add_argument("--working-dir", help="where MODULE is imported from here (default: the current directory)")
    return p.parse_known_args(argv)


def build_main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if not args.kubernetes:
        print("error: dynamo build writes Kubernetes manifests only: give --kubernetes DIR (container images "
              "are not built here; name one with --image)", file=sys.stderr)
        return 2
    working_dir = os.path.abspath(args.working_dir or os.getcwd())
    module = args.target.partition(":")[0]
    try:
        graph = walk(import_root(args.target, working_dir))
        config = build_config(graph, args.file, overrides)
        for spec in graph.order:
            workers_of(config, spec.name)
        files = manifests(graph, config, args.target, name=args.name or module.rsplit(".", 1)[-1],
                          image=args.image, etcd=args.etcd_endpoints, nats=args.nats_server,
                          workdir=args.image_workdir)
    except (GraphError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.kubernetes, exist_ok=True)
        for file_name, objects in files.items():
            path = os.path.join(args.kubernetes, file_name)
            with open(path, "w", encoding="utf-8") as f:
                yaml.safe_dump_all(objects, f, sort_keys=False)
            kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects)
            print(f"wrote {path}: {kinds}")
    except OSError as e:
        print(f"error: cannot write {args.kubernetes}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
