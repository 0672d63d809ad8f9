"""Build an engine in a worker thread when its constructor insists on the main thread for signals.

Some engines (SGLang's ``sgl.Engine``) install signal handlers while they start, which Python allows
only on the main thread, so they used to be built on the event loop's thread, blocking the loop for
the whole load (minutes), which starved the etcd lease keep-alive and NATS pings. Here the constructor
runs in a thread; each ``signal.signal`` call it makes from that thread is handed to the loop (the main
thread), executed there, and its result handed back, while the loop stays free for everything else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def run_off_loop_with_signals(fn: Callable[[], T]) -> T:
    """``await asyncio.to_thread(fn)``, with ``fn``'s ``signal.signal`` calls done on this loop's thread.

    Must be awaited from the main thread's loop (signals live there). The patch of ``signal.signal`` lasts
    only while ``fn`` runs; calls from the main thread itself go straight through.
    """
    if threading.current_thread() is not threading.main_thread():
        return await asyncio.to_thread(fn)  # no main thread to forward to: the engine decides
    loop = asyncio.get_running_loop()
    original = signal.signal

    def forwarded(signum: Any, handler: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            return original(signum, handler)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                done.set_result(original(signum, handler))
            except BaseException as e:  # noqa: BLE001 - raised in the calling thread instead
                done.set_exception(e)

        loop.call_soon_threadsafe(on_loop)
        return done.result()

    signal.signal = forwarded  # type: ignore[assignment]
    try:
        return await asyncio.to_thread(fn)
    finally:
        signal.signal = original
