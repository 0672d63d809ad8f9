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
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from dynamo.bounds import track
from dynamo.errors import RequestError, ServiceUnavailableError
from dynamo.frontend.http.metrics import FrontendMetrics, RequestMetrics
from dynamo.frontend.http.traced import bind, record_usage
from dynamo.llm.engine import Context
from dynamo.runtime import tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger(__name__)

_MODEL = web.RequestKey("dynamo_model", str)  # the request's model once it is known: its rejection's label


class Admission:
    def __init__(self, limit: int, metrics: FrontendMetrics):
        self.limit = limit
        self.metrics = metrics
        self.admitted = 0  # requests past the gate and not finished (some still reading their body)
        self.tasks: set[asyncio.Task[Any]] = set()  # the handlers of requests under way: shutdown waits for them
        self.contexts: set[Context] = set()  # their engines' contexts: shutdown stops them past its grace
        track("http_requests_in_flight", self, lambda a: len(a.tasks))
        track("http_contexts_in_flight", self, lambda a: len(a.contexts))

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

    def run(self, request: web.Request, ctx: Context, model: str, endpoint: str, streaming: bool,
            max_tokens: int | None = None) -> "InFlight":
        """A request that knows its model starts its engine: ``with admission.run(...) as flight:`` counts
        it in flight and gives its metrics; leaving the block ends it (see :class:`InFlight`).  Traced,
        the request's server span becomes its context's trace (traced.py)."""
        request[_MODEL] = model
        if tracing.ENABLED:
            bind(ctx, model, max_tokens)
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.contexts.add(ctx)
        return InFlight(self, ctx, self.metrics.request(model, endpoint, streaming), task)


def error_type(exc: BaseException | None) -> str:
    """``requests_total``'s ``error_type`` of a failed request, by what ended it: ``cancelled`` (the client
    went away), ``overloaded`` (every worker busy), ``unavailable`` (no worker, or none reachable),
    ``invalid_request`` (a 4xx), ``internal`` (the engine failed: an exception, or an error mid-stream)."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, ServiceUnavailableError):
        return "overloaded" if exc.overload else "unavailable"
    if isinstance(exc, RequestError):
        return "invalid_request" if exc.status < 500 else "internal"
    return "internal"


class InFlight:
    """One admitted request's engine run, as a ``with`` block around it. The handler sets ``ok`` once
    the request completed without error; leaving the block records the outcome in the metrics and stops
    counting the request in flight. A handler cancelled inside it (the client went away, or shutdown past
    its grace) kills the context first, so the engine stops its work for nobody.
    """

    __slots__ = ("admission", "ctx", "metrics", "ok", "_task")

    def __init__(self, admission: Admission, ctx: Context, metrics: RequestMetrics,
                 task: "asyncio.Task[Any] | None") -> None:
        self.admission = admission
        self.ctx = ctx
        self.metrics = metrics
        self.ok = False
        self._task = task

    def __enter__(self) -> "InFlight":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            self.ctx.kill()
            log.debug("request %s cancelled: client went away", self.ctx.id)
            self.admission.metrics.client_gone()
        self.metrics.done(self.ok, error_type(exc))
        if self.ctx.trace is not None:
            record_usage(self.ctx)
        self.admission.contexts.discard(self.ctx)
        if self._task is not None:
            self.admission.tasks.discard(self._task)
