"""Finding a graph: import ``module:Service``, walk its ``depends``/``link`` edges, order the services.

Both the supervisor and every service process load the graph the same way (the process is told the root
and its own name, and finds its class by walking from the root), so a service defined in another module
than the root is found without naming its module.  A cycle is refused here, before anything starts: the
start order (dependencies first) and the stop order (dependents first) would not exist.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from .service import ServiceSpec, is_service, spec_of


class GraphError(ValueError):
    """A graph that cannot be served; the message is one line for the user."""


@dataclass
class Graph:
    root: ServiceSpec
    order: list[ServiceSpec]  # dependencies before their dependents; the root last
    edges: dict[str, list[str]]  # service -> the services it depends on

    def by_name(self, name: str) -> ServiceSpec:
        for spec in self.order:
            if spec.name == name:
                return spec
        raise GraphError(f"no service {name!r} in the graph of {self.root.name}")


def import_root(target: str, working_dir: str | None = None) -> type:
    """``module.path:Service`` -> the class, importing from ``working_dir`` (default: the current directory)."""
    if ":" not in target:
        raise GraphError(f"expected MODULE:Service (e.g. graphs.agg:Frontend), got {target!r}")
    module_name, _, attr = target.partition(":")
    base = os.path.abspath(working_dir or os.getcwd())
    if base not in sys.path:
        sys.path.insert(0, base)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise GraphError(f"cannot import {module_name!r} from {base}: {e}") from None
        raise
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise GraphError(f"module {module_name!r} has no {attr!r}")
    if not is_service(obj):
        raise GraphError(f"{target} is not a @service class")
    return obj


def walk(root_cls: type) -> Graph:
    """The services reachable from ``root_cls``, dependencies first; a cycle is a :class:`GraphError`."""
    root = spec_of(root_cls)
    order: list[ServiceSpec] = []
    edges: dict[str, list[str]] = {}
    state: dict[type, str] = {}  # "visiting" on the current path, "done" once ordered
    names: dict[str, type] = {}

    def visit(spec: ServiceSpec, path: list[str]) -> None:
        if state.get(spec.cls) == "done":
            return
        if state.get(spec.cls) == "visiting":
            cycle = path[path.index(spec.name):] + [spec.name]
            raise GraphError("cycle in depends: " + " -> ".join(cycle))
        other = names.setdefault(spec.name, spec.cls)
        if other is not spec.cls:
            raise GraphError(f"two services are named {spec.name} ({other.__module__} and {spec.cls.__module__}): "
                             "a service's name is its class name")
        state[spec.cls] = "visiting"
        deps = [spec_of(d) for d in spec.dependencies()]
        edges[spec.name] = [d.name for d in deps]
        for dep in deps:
            visit(dep, path + [spec.name])
        state[spec.cls] = "done"
        order.append(spec)

    visit(root, [])
    return Graph(root=root, order=order, edges=edges)
