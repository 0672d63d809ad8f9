"""Small asyncio helpers shared across the package."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: "asyncio.Task[object] | None") -> None:
    """Cancel a background task and wait until it has really ended, ignoring how it ended.

    Used on close paths, where the task's own failure has already been logged and must not stop the
    rest of the shutdown.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
