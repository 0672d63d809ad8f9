"""One replica of one service, the process ``dynamo serve`` starts per replica.

``python -m dynamo.sdk.runner MODULE:Root Service REPLICA [--working-dir DIR]``: load the graph as the
supervisor did, connect a runtime (the zero-infrastructure default or etcd/NATS, by the same rule as every
other command), fill ``dynamo_context``, build the class (its ``__init__`` runs here and only here), await
its ``@async_on_start`` hooks, serve every ``@endpoint`` on ``dyn://<namespace>.<Class>.<name>`` and the
``@api`` routes on the ``port`` of its config section, then log one ready line (and write
:data:`READY_MARK` for the supervisor, which starts this service's dependents on it).  SIGTERM/SIGINT: the HTTP
routes stop, the endpoints deregister and drain (the runtime's graceful shutdown), then the
``@async_on_shutdown`` hooks run.

A service that cannot start (its ``__init__`` or a start hook raised, its graph does not load, the runtime
cannot connect) writes one line starting with :data:`FATAL_MARK` and exits with :data:`FATAL_EXIT`: the
supervisor shows that line once, does not restart the replica (it would fail again) and stops the graph.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import sys
from typing import Any, AsyncIterator, Callable

from dynamo.cli.logs import setup_logging
from dynamo.runtime import DistributedRuntime, run_worker, tracing

from .annotations import convert, request_annotation
from .client import to_wire
from .context import dynamo_context
from .graph import GraphError, import_root, walk
from .http import DEFAULT_HOST, DEFAULT_PORT, start_api
from .lib.config import ConfigError, ServiceConfig
from .service import ServiceSpec

log = logging.getLogger("dynamo.sdk.runner")  # not __name__: run as __main__

FATAL_EXIT = 3
FATAL_MARK = "DYNAMO_SERVE_FATAL "
READY_MARK = "DYNAMO_SERVE_READY"  # the supervisor starts the dependents of a service on it (not shown)


class ServiceStartError(Exception):
    """The service's own code failed before it served; the message names the service."""


def endpoint_handler(instance: Any, fn: Callable[..., Any]) -> Callable[[Any], AsyncIterator[Any]]:
    """The runtime handler of one ``@endpoint`` method: the request converted by its annotation, the
    yielded items made JSON-able (a pydantic model as its dict)."""
    ann = request_annotation(fn)
    bound = fn.__get__(instance, type(instance))
    if not inspect.isasyncgenfunction(fn):
        raise ServiceStartError(f"{type(instance).__name__}.{fn.__name__}: an @endpoint must be an async generator")

    async def handler(request: Any) -> AsyncIterator[Any]:
        async for item in bound(convert(ann, request)):
            yield to_wire(item)

    return handler


async def _hooks(spec: ServiceSpec, instance: Any, kind: str) -> None:
    for hook in spec.hooks(kind):
        result = hook(instance)
        if inspect.isawaitable(result):
            await result


async def serve_service(runtime: DistributedRuntime, spec: ServiceSpec, replica: int) -> None:
    config = ServiceConfig.get_instance()
    section = config.get(spec.name) or {}
    component = runtime.namespace(spec.namespace).component(spec.name)
    endpoints = spec.endpoints()
    dynamo_context.update(runtime=runtime, namespace=spec.namespace, service=spec.name, component=component,
                          endpoints=sorted(endpoints), lease=runtime.instance_id, replica=replica)
    try:
        instance = spec.cls()
    except Exception as e:
        raise ServiceStartError(f"service {spec.name} failed to start: __init__ raised {type(e).__name__}: {e}") from e
    try:
        await _hooks(spec, instance, "start")
    except Exception as e:
        raise ServiceStartError(f"service {spec.name} failed to start: an @async_on_start hook raised "
                                f"{type(e).__name__}: {e}") from e
    served: list[asyncio.Task[None]] = []
    readies: list[asyncio.Event] = []
    for name, fn in endpoints.items():
        ready = asyncio.Event()
        readies.append(ready)
        handler = endpoint_handler(instance, fn)
        served.append(asyncio.create_task(component.endpoint(name).serve_endpoint(handler, ready=ready)))
    api_runner = None
    try:
        for ready, task in zip(readies, served, strict=True):
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                waiter.cancel()
                task.result()  # raises what stopped it
        where = [f"dyn://{spec.namespace}.{spec.name}.{n}" for n in sorted(endpoints)]
        routes = spec.apis()
        if routes:
            host = str(section.get("host", DEFAULT_HOST))
            port = int(section.get("port", DEFAULT_PORT))
            try:
                api_runner = await start_api(instance, routes, host, port)
            except OSError as e:
                raise ServiceStartError(f"service {spec.name} failed to start: cannot listen on {host}:{port}: "
                                        f"{e.strerror or e}") from e
            where += [f"http://{host}:{port}/{n}" for n in sorted(routes)]
        log.info("service %s replica %d ready (instance %s): %s", spec.name, replica, runtime.instance_hex,
                 ", ".join(where) or "no endpoints")
        print(READY_MARK, file=sys.stderr, flush=True)
        await runtime.wait_for_shutdown()
        if api_runner is not None:
            await api_runner.cleanup()
            api_runner = None
        await asyncio.gather(*served)
    finally:
        if api_runner is not None:
            await api_runner.cleanup()
        for task in served:
            task.cancel()
        await _hooks(spec, instance, "shutdown")


async def _main(root: str, name: str, replica: int, working_dir: str | None) -> None:
    graph = walk(import_root(root, working_dir))
    spec = graph.by_name(name)
    if not os.environ.get("DYN_LOG"):  # the service's own logs show at info, as ours do
        logging.getLogger(spec.cls.__module__).setLevel(logging.INFO)
    runtime = await DistributedRuntime.connect()
    await run_worker(runtime, serve_service, spec, replica)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynamo.sdk.runner")
    p.add_argument("root")
    p.add_argument("service")
    p.add_argument("replica", type=int)
    p.add_argument("--working-dir")
    args = p.parse_args(argv)
    setup_logging()
    try:
        tracing.init(args.service)  # the service's class name, unless OTEL_SERVICE_NAME says one
        asyncio.run(_main(args.root, args.service, args.replica, args.working_dir))
    except (ServiceStartError, GraphError, ConfigError, ConnectionError, tracing.TracingSetupError) as e:
        msg = str(e) if isinstance(e, ServiceStartError) else f"service {args.service} failed to start: {e}"
        print(FATAL_MARK + msg, file=sys.stderr, flush=True)
        return FATAL_EXIT
    except KeyboardInterrupt:
        return 130
    finally:
        tracing.shutdown()  # the spans still buffered leave before the process does
    if dynamo_context.get("fatal"):  # a role it ran failed the way every restart would (lib/roles.py)
        print(FATAL_MARK + dynamo_context["fatal"], file=sys.stderr, flush=True)
        return FATAL_EXIT
    return int(dynamo_context.get("exit_status", 0))


if __name__ == "__main__":
    sys.exit(main())
