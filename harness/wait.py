"""Awaiting an observable event in a test: poll a predicate with a deadline instead of sleeping blindly."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

import pytest


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """:func:`wait_until` inside an event loop: ``predicate`` (plain, or returning an awaitable) is polled
    between loop turns, so the code under test runs meanwhile; its first truthy value is returned."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
