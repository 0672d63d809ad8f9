"""The SDK's decorators: what a graph's classes declare, read by ``dynamo serve`` and by each service process.

A graph is written as plain classes (the style of Dynamo 0.1-0.3's SDK): ``@service`` on the class,
``@endpoint()`` on the async-generator methods other services call over the runtime, ``@api()`` on the
methods served over HTTP, ``depends(Other)`` as a class attribute for each edge, ``@async_on_start`` and
``@async_on_shutdown`` on hooks.  The decorators only *record* (an attribute on the class or function):
nothing connects or starts at import time, so the supervisor can import a graph to walk it, and a
service's ``__init__`` runs only in that service's own process.

``@service`` returns the class itself (not a wrapper), so the class stays usable and testable as a
plain class; what the SDK knows about it is its :class:`ServiceSpec` (``spec_of(cls)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DEFAULT_NAMESPACE = "dynamo"
SPEC_ATTR = "__dynamo_service__"
ENDPOINT_ATTR = "__dynamo_endpoint__"
API_ATTR = "__dynamo_api__"
HOOK_ATTR = "__dynamo_hook__"


@dataclass
class ServiceSpec:
    """What ``@service`` recorded about a class."""

    cls: type
    name: str
    namespace: str
    workers: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    image: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other decorator arguments, kept for --dry-run
    links: list[type] = field(default_factory=list)  # edges added with .link()

    def endpoints(self) -> dict[str, Callable[..., Any]]:
        """Endpoint name -> function, over the class and its bases."""
        return _marked(self.cls, ENDPOINT_ATTR)

    def apis(self) -> dict[str, Callable[..., Any]]:
        return _marked(self.cls, API_ATTR)

    def hooks(self, kind: str) -> list[Callable[..., Any]]:
        return [fn for fn in _functions(self.cls) if getattr(fn, HOOK_ATTR, None) == kind]

    def dependencies(self) -> list[type]:
        """The services this one calls: its ``depends`` attributes, then its links, without repeats."""
        out: list[type] = []
        for dep in _dependency_attrs(self.cls).values():
            if dep.target not in out:
                out.append(dep.target)
        for target in self.links:
            if target not in out:
                out.append(target)
        return out

    def service_args(self) -> dict[str, Any]:
        """The decorator's contribution to the config (the lowest layer but the constructor's defaults)."""
        args: dict[str, Any] = {"workers": self.workers}
        if self.resources:
            args["resources"] = dict(self.resources)
        if self.image:
            args["image"] = self.image
        return args


def _functions(cls: type) -> list[Any]:
    seen: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            seen[name] = value
    return list(seen.values())


def _marked(cls: type, attr: str) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for fn in _functions(cls):
        name = getattr(fn, attr, None)
        if name is not None:
            out[name] = fn
    return out


def _dependency_attrs(cls: type) -> dict[str, "Dependency"]:
    out: dict[str, Dependency] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Dependency):
                out[name] = value
    return out


def spec_of(obj: Any) -> ServiceSpec:
    """The spec of a ``@service`` class; a clear error for anything else."""
    spec = getattr(obj, SPEC_ATTR, None)
    if not isinstance(spec, ServiceSpec) or spec.cls is not obj:
        raise TypeError(f"{getattr(obj, '__name__', obj)!r} is not a @service class")
    return spec


def is_service(obj: Any) -> bool:
    spec = getattr(obj, SPEC_ATTR, None)
    return isinstance(spec, ServiceSpec) and spec.cls is obj


def service(cls: type | None = None, *, dynamo: dict[str, Any] | None = None, resources: dict[str, Any] | None = None,
            workers: int = 1, image: str | None = None, **extra: Any) -> Any:
    """``@service(dynamo={"namespace": "ns"}, resources={...}, workers=N, image=...)`` on a class.

    Bare ``@service`` works too.  Unknown keyword arguments (the original's ``traffic=``, ...) are kept and
    shown by ``--dry-run`` but change nothing here.
    """

    def wrap(klass: type) -> type:
        namespace = (dynamo or {}).get("namespace") or DEFAULT_NAMESPACE
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"@service on {klass.__name__}: workers must be an integer >= 1, not {workers!r}")
        spec = ServiceSpec(cls=klass, name=klass.__name__, namespace=str(namespace), workers=workers,
                           resources=dict(resources or {}), image=image, extra=dict(extra))
        setattr(klass, SPEC_ATTR, spec)

        def link(target: Any) -> Any:
            """``A.link(B).link(C)``: add the edge A -> B at import time; returns B to chain."""
            spec_of(target)
            if target not in spec.links:
                spec.links.append(target)
            return target

        klass.link = staticmethod(link)  # type: ignore[attr-defined]
        return klass

    return wrap(cls) if cls is not None else wrap


def _method_marker(attr: str, fn: Callable[..., Any] | None, name: str | None) -> Any:
    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, attr, name or f.__name__)
        return f

    return mark(fn) if fn is not None else mark


def endpoint(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """``@endpoint()``: an async-generator method served on ``dyn://<namespace>.<Class>.<name>``."""
    return _method_marker(ENDPOINT_ATTR, fn, name)


dynamo_endpoint = endpoint


def api(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """``@api()``: the method answers ``POST /<name>`` on the service's HTTP port."""
    return _method_marker(API_ATTR, fn, name)


def async_on_start(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Awaited after ``__init__``, before the service's endpoints are served."""
    setattr(fn, HOOK_ATTR, "start")
    return fn


def async_on_shutdown(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Awaited once the endpoints have drained, before the process exits."""
    setattr(fn, HOOK_ATTR, "shutdown")
    return fn


class Dependency:
    """``other = depends(Other)``: an edge of the graph, and on an instance a client of ``Other``.

    The client is built on first access in the service's process (it needs that process's runtime, which
    :mod:`dynamo.sdk.context` holds); on the class (no instance) the descriptor itself is returned.
    """

    def __init__(self, target: Any) -> None:
        spec_of(target)
        self.target: type = target
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        cache = instance.__dict__.setdefault("__dynamo_clients__", {})
        key = self.attr or id(self)
        if key not in cache:
            from .client import ServiceClient

            cache[key] = ServiceClient(spec_of(self.target))
        return cache[key]


def depends(target: T) -> Any:
    return Dependency(target)
