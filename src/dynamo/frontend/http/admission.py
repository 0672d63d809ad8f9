"""The frontend-wide limit on requests in progress (``--max-inflight`` on in=http), and what is in flight.

One gate for every route that runs an engine (chat, completions, embeddings, responses), so they all
shed load the same way: past the limit a request gets a 503 with ``Retry-After`` and an OpenAI error
body at once, before its body is read (a refusal costs next to nothing), and is counted in
``<prefix>_model_rejection`` with its endpoint (the model is not known yet: ``model=""``).  A request
that got in and then found every worker busy (the workers' queue full or its wait over) is counted there
as well, with its model.  Both 503s are ``overload`` errors (docs/reliability.md).

The same object knows the requests in flight (their tasks and contexts): ``HttpService.stop`` waits for
them and, past its grace period, stops their engines so each ends cleanly.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

from dynamo.errors import ServiceUnavailableError
from dynamo.frontend.http.metrics import FrontendMetrics, RequestMetrics
from dynamo.llm.engine import Context

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_MODEL = web.RequestKey("dynamo_model", str)  # the request's model once it is known: its rejection's label


class Admission:
    def __init__(self, limit: int, metrics: FrontendMetrics):
        self.limit = limit
        self.metrics = metrics
        self.admitted = 0  # requests past the gate and not finished (some still reading their body)
        self.tasks: set[asyncio.Task[Any]] = set()  # the handlers of requests under way: shutdown waits for them
        self.contexts: set[Context] = set()  # their engines' contexts: shutdown stops them past its grace

    def gate(self, endpoint: str, handler: Handler) -> Handler:
        """``handler`` behind the limit; ``endpoint`` names it in the rejection counter."""

        async def admit(request: web.Request) -> web.StreamResponse:
            if self.admitted >= self.limit:
                self.metrics.rejected("", endpoint)  # the body is not read: the model is not known
                raise ServiceUnavailableError(
                    f"Too many requests in progress (limit {self.limit}); try again shortly", overload=True)
            self.admitted += 1
            try:
                return await handler(request)
            except ServiceUnavailableError as e:
                if e.overload:  # every worker busy
                    self.metrics.rejected(request.get(_MODEL, ""), endpoint)
                raise
            finally:
                self.admitted -= 1

        return admit

    def begin(self, request: web.Request, ctx: Context, model: str, endpoint: str,
              streaming: bool) -> RequestMetrics:
        """A request that knows its model starts its engine: its metrics, and it counts as in flight."""
        request[_MODEL] = model
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.contexts.add(ctx)
        return self.metrics.request(model, endpoint, streaming)

    def end(self, ctx: Context, rm: RequestMetrics, ok: bool) -> None:
        """The request begun with :meth:`begin` is over (``ok``: it completed without error)."""
        rm.done(ok)
        self.contexts.discard(ctx)
        task = asyncio.current_task()
        if task is not None:
            self.tasks.discard(task)
