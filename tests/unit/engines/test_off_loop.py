"""Building an engine off the event loop while its signal handlers still land on the main thread."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from dynamo.engines.off_loop import run_off_loop_with_signals


def _handler(signum, frame) -> None:  # pragma: no cover - never delivered
    pass


async def test_constructor_runs_in_a_thread_with_its_signal_handlers_installed_on_the_main_thread():
    previous = signal.getsignal(signal.SIGUSR2)
    loop_ran = threading.Event()

    def build() -> str:
        # plain signal.signal from a thread raises ValueError; through the shim it is done on the main
        # thread, which is only possible because the loop is free while we are blocked here
        signal.signal(signal.SIGUSR2, _handler)
        assert loop_ran.wait(5), "the event loop did not run while the engine was being built"
        return threading.current_thread().name

    async def on_loop() -> None:
        await asyncio.sleep(0)
        loop_ran.set()

    try:
        task = asyncio.create_task(on_loop())
        where = await run_off_loop_with_signals(build)
        await task
        assert where != threading.main_thread().name
        assert signal.getsignal(signal.SIGUSR2) is _handler
        assert signal.signal is not None and signal.signal.__module__ in ("_signal", "signal")  # restored
    finally:
        signal.signal(signal.SIGUSR2, previous)


async def test_errors_of_the_forwarded_call_reach_the_constructor():
    def build() -> None:
        signal.signal(signal.SIGKILL, _handler)  # cannot be caught: OSError/ValueError on the main thread

    with pytest.raises((OSError, ValueError)):
        await run_off_loop_with_signals(build)
