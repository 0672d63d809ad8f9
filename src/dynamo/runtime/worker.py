"""``@dynamo_worker``: turn ``async def worker(runtime, ...)`` into a process entry point.

The wrapped coroutine function, called without the runtime (``asyncio.run(worker())``), connects a
DistributedRuntime on the running loop, passes it in, and on SIGINT/SIGTERM shuts it down gracefully:
the lease is revoked (deregistration), ``serve_endpoint`` drains in-flight requests and returns, then
the runtime is closed. A second signal cancels the worker at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from typing import Any, Awaitable, Callable

from .config import RuntimeSettings
from .distributed import DistributedRuntime

log = logging.getLogger(__name__)

EXTRA_GRACE = 5.0  # beyond the drain timeout, for the worker function to return by itself


def dynamo_worker(static: bool = False, settings: RuntimeSettings | None = None) -> Callable:
    def decorator(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            runtime = await DistributedRuntime.connect(settings, static=static)
            return await run_worker(runtime, fn, *args, **kwargs)

        return wrapper

    return decorator


async def run_worker(runtime: DistributedRuntime, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(runtime, ...)`` with signal-driven graceful shutdown; always closes the runtime."""
    loop = asyncio.get_running_loop()
    task: asyncio.Future[Any] = asyncio.ensure_future(fn(runtime, *args, **kwargs))
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("received %s: shutting down gracefully", signal.Signals(signum).name)
            runtime.shutdown()
            grace = runtime.settings.graceful_shutdown_timeout + EXTRA_GRACE
            loop.call_later(grace, task.cancel)
        else:
            task.cancel()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
            pass
    try:
        return await task
    except asyncio.CancelledError:
        if signals_seen:
            return None
        raise
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await runtime.close()
