"""Per-request context: the request id plus stop/kill signalling between client and handler.

``stop`` asks for a graceful end (the handler may finish what it is doing); ``kill`` means nobody is
listening any more (the handler's generator is closed at once). Both are observable by polling
(``is_stopped()``), by awaiting (``await ctx.stopped()``), or by callbacks (how transports hook in).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable


class Context:
    __slots__ = ("_id", "_stopped", "_killed", "_event", "_callbacks", "trace")

    def __init__(self, request_id: str | None = None) -> None:
        # the span a request sent with this context is a child of (runtime/tracing.py; None: tracing off,
        # or this task's current span): the worker's ingress sets its own server span here
        self.trace: Any = None
        self._id = request_id or str(uuid.uuid4())
        self._stopped = False
        self._killed = False
        self._event: asyncio.Event | None = None
        self._callbacks: list[Callable[[str], None]] = []

    def id(self) -> str:
        return self._id

    def is_stopped(self) -> bool:
        """True once stop or kill was requested."""
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        """Ask the producer to end the stream gracefully."""
        self._signal("stop")

    stop = stop_generating

    def kill(self) -> None:
        """Abandon the stream: the producer's work is cancelled."""
        self._signal("kill")

    def _signal(self, kind: str) -> None:
        if kind == "kill":
            if self._killed:
                return
            self._killed = True
        elif self._stopped:
            return
        self._stopped = True
        if self._event is not None:
            self._event.set()
        for cb in list(self._callbacks):
            cb(kind)

    def add_callback(self, callback: Callable[[str], None]) -> None:
        """``callback("stop" | "kill")`` on each new signal (a kill after a stop fires again)."""
        self._callbacks.append(callback)

    def remove_callback(self, callback: Callable[[str], None]) -> None:
        try:
            self._callbacks.remove(callback)
        except ValueError:
            pass

    async def stopped(self) -> None:
        """Wait until stop or kill is requested."""
        if self._stopped:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    async_killed_or_stopped = stopped  # name used by the original's Python binding

    def __repr__(self) -> str:
        return f"Context(id={self._id!r}, stopped={self._stopped}, killed={self._killed})"
