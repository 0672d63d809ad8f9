"""The one engine interface: ``generate(request, context) -> async iterator``.

Core engines (``kind = "core"``) take a :class:`PreprocessedRequest` and yield :class:`EngineOutput`
token items; full engines (``kind = "full"``) take an OpenAI request and yield OpenAI chunk dicts.  The
:class:`Context` carries the request id and cancellation both ways: the consumer calls
``stop_generating()`` (a stop condition fired, or the client went away) and the engine checks
``is_stopped`` or awaits ``stopped()`` to end its work early.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, runtime_checkable


class Context:
    """Per-request state shared by the input, the pipeline stages and the engine."""

    __slots__ = ("id", "_stopped", "_killed", "_event", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "annotations", "_callbacks", "stamps")

    def __init__(self, request_id: str | None = None):
        self.id = request_id or uuid.uuid4().hex
        self._stopped = False
        self._killed = False
        self._event: asyncio.Event | None = None
        # filled by the pipeline as it goes; the HTTP layer reads them for metrics and usage
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # prompt tokens the engine served from its prefix cache; None: the engine did not say
        self.cached_tokens: int | None = None
        self.annotations: dict[str, Any] = {}
        self._callbacks: list[Any] = []
        # time-to-first-token stamps (first_token.py), only while the dynamo.ttft debug log is on
        self.stamps: list[Any] | None = None

    def on_stop(self, callback: Any) -> None:
        """``callback("stop" | "kill")`` when the request is stopped or killed (transports hook in here)."""
        self._callbacks.append(callback)

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        """Ask the engine to finish; what it already produced is still wanted."""
        if not self._stopped:
            self._stopped = True
            if self._event is not None:
                self._event.set()
            for cb in self._callbacks:
                cb("stop")

    def kill(self) -> None:
        """The consumer is gone: stop at once, nothing more will be read."""
        if self._killed:
            return
        self._killed = True
        if not self._stopped:
            self._stopped = True
            if self._event is not None:
                self._event.set()
        for cb in self._callbacks:
            cb("kill")

    async def stopped(self) -> None:
        """Wait until the request is stopped (for engines that wait on something else meanwhile)."""
        if self._stopped:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()


@runtime_checkable
class Engine(Protocol):
    kind: str  # "core" (token ids in and out) or "full" (OpenAI requests in, chunks out)

    def generate(self, request: Any, context: Context) -> AsyncIterator[Any]: ...


@dataclass
class EngineInfo:
    """What an engine tells the pipeline builder about itself."""

    name: str
    kind: str  # "core" (token ids in and out) or "full" (OpenAI requests in, chunks out)
    needs_tokenizer: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
