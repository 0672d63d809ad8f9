"""Engines that forward requests to workers on the distributed runtime.

``RemoteCoreEngine`` sends pre-processed requests to Backend workers and yields their token items; it
picks the worker through a :class:`RouterPolicy` and, when a worker dies mid-stream, moves the request
to another worker up to the card's ``migration_limit`` times: the resumed request carries the
prompt plus the tokens already generated, and a smaller ``max_tokens``.  ``RemoteChatEngine`` forwards
OpenAI requests to Chat workers unchanged.

Both send a request that found *no responder* (the instance died and its lease has not expired yet) to
another instance whatever the migration limit (the original does so only while migration attempts
remain): nothing reached a worker, so it is always safe, and requests keep succeeding right after a crash.
A request a worker did not acknowledge in time (frozen) or refused as busy goes to another one too, and
so does, mid-stream, a request that a shutting-down worker handed back when its drain timed out (the
worker says so with a ``drained`` item): a scale-down never fails a request, whatever the migration limit.

Overload: when every worker is at its announced limit of requests in flight, a request waits in the
client's queue (at most ``QueuePolicy.size`` waiting, each at most ``QueuePolicy.timeout`` seconds), then
gets a 503 with ``Retry-After`` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import msgspec

from dynamo.errors import EngineError as LlmEngineError
from dynamo.errors import RequestError, ServiceUnavailableError
from dynamo.lazyjson import USAGE_KEY, LazyJson
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.llm.protocols.v1 import V1_OUTPUT_KEY, PeerRequest, engine_output_from_v1
from dynamo.runtime import (
    STREAM_INCOMPLETE_MESSAGE,
    InstanceNotFoundError,
    NoInstancesError,
    NoRespondersError,
    RuntimeConnectionError,
    StreamIncompleteError,
    WorkerBusyError,
    WorkerDrainedError,
    tracing,
)
from dynamo.runtime import (
    Context as RtContext,
)
from dynamo.runtime import (
    EngineError as RtEngineError,
)

log = logging.getLogger(__name__)

INSTANCE_WAIT_S = 5.0  # how long a request waits for a worker to appear before a 503
# A request that found no responder on an instance's subject never reached a worker (the instance died
# and its lease has not expired yet): it is sent to another instance, without using a migration attempt.
MAX_NO_RESPONDER_RETRIES = 8
# A request a draining worker handed back (it shut down before the request ended) is resumed on another
# worker whatever the migration limit, at most this many times (each drain is a deliberate scale-down).
MAX_DRAIN_RESUMES = 8
NO_WORKER_MESSAGE = "No worker is serving this model right now; try again shortly"
BUSY_MESSAGE = "Every worker serving this model is busy; try again shortly"
UNREACHABLE_MESSAGE = "The workers cannot be reached right now (NATS is not connected); try again shortly"


@dataclass
class QueuePolicy:
    """How requests wait for a worker with room (``--queue-size``, ``--queue-timeout``)."""

    size: int = 256  # requests that may wait at once; one more is answered 503 at once
    timeout: float = 30.0  # seconds one request may wait before its 503
    retry_after: int = 1  # the 503's Retry-After, in seconds


@dataclass
class RouterConfig:
    """How a frontend routes a model's requests (the --router-mode family of flags, migration, the queue)."""

    mode: str = "round-robin"
    # --kv-overlap-score-weight; None: what the model's workers suggest, else 2.0 (the original: 1.0;
    # docs/routing.md, "Choosing the default overlap weight")
    kv_overlap_score_weight: float | None = None
    router_temperature: float = 0.0
    use_kv_events: bool = True
    # --router-replica-sync: share the KV router's in-flight bookings with the other frontends (kv_policy.py)
    router_replica_sync: bool = True
    # --migration-limit on the frontend: a request may move this many times, or as many as the worker's
    # card allows if that is more (Dynamo 1.x sets it on the frontend, 0.x on the worker)
    migration_limit: int = 0
    queue: QueuePolicy = field(default_factory=QueuePolicy)  # --queue-size / --queue-timeout
    max_local_prefill_length: int | None = None  # disaggregation: None is disagg/plan.py's default


class RouterPolicy(Protocol):
    """How a model's requests pick a worker, and what the router hears about its workers."""

    def open(self, client: Any, request: PreprocessedRequest, rt_ctx: RtContext) -> Any: ...

    def finished(self, request_id: str, output_tokens: int = 0) -> None: ...

    def first_token(self, request_id: str) -> None: ...

    def add_worker(self, entry: Any) -> None:
        """A worker's model entry appeared."""

    def remove_worker(self, worker_id: int) -> None:
        """A worker's model entry went away."""

    async def follow_component(self, namespace: str, component: str, endpoint: str) -> None:
        """Another component serves the model too: follow its routers' events."""

    @property
    def kv_router(self) -> Any:
        """The KV router behind the policy (the per-worker load gauges read it), or None."""

    async def close(self) -> None: ...


class SimpleRouter:
    """round-robin or random over the endpoint's live instances."""

    def __init__(self, mode: str):
        self.mode = mode

    def open(self, client: Any, request: PreprocessedRequest, rt_ctx: RtContext) -> Any:
        body = PeerRequest(request)  # our dict, or 1.x's for a 1.x worker
        if request.backend_instance_id is not None:
            return client.direct(body, request.backend_instance_id, context=rt_ctx)
        if self.mode == "random":
            return client.random(body, context=rt_ctx)
        return client.round_robin(body, context=rt_ctx)

    def finished(self, request_id: str, output_tokens: int = 0) -> None:
        pass

    def first_token(self, request_id: str) -> None:
        pass

    def add_worker(self, entry: Any) -> None:
        pass

    def remove_worker(self, worker_id: int) -> None:
        pass

    async def follow_component(self, namespace: str, component: str, endpoint: str) -> None:
        pass

    @property
    def kv_router(self) -> None:
        return None

    async def close(self) -> None:
        pass


def _link(ctx: Context, rt_ctx: RtContext) -> None:
    ctx.on_stop(lambda kind: rt_ctx.kill() if kind == "kill" else rt_ctx.stop_generating())


class WorkerStarts:
    """Starts one request's stream on a worker with room: the one retry loop of every remote engine
    (Backend, Chat/Completion and Embedding models), for its first start and, for a Backend model, for
    each migration.

    Each start waits for a worker to exist (``INSTANCE_WAIT_S``, then a 503), then for one with room
    (the client's queue, ``queue``; a 503 with ``Retry-After`` marked ``overload`` when the queue is full
    or the wait is over), then opens the stream.  A worker that refused the request as busy is skipped for
    a moment; an instance with no responder (it died and its lease has not expired yet) is skipped and the
    request sent to another, at most ``MAX_NO_RESPONDER_RETRIES`` times over the request's whole life,
    each counted as a ``new_request`` migration.
    """

    __slots__ = ("client", "queue", "observer", "request_id", "no_responders")

    def __init__(self, client: Any, queue: QueuePolicy, observer: Any, request_id: str):
        self.client = client
        self.queue = queue
        self.observer = observer  # counts migrations (dynamo.frontend.worker_metrics.ModelObserver), or None
        self.request_id = request_id
        self.no_responders = 0

    async def start(self, open_stream: Callable[[], Any],
                    prepare: Callable[[], Awaitable[None]] | None = None,
                    trace: tracing.Span | None = None) -> Any:
        """``open_stream()``'s stream, started; ``prepare`` is awaited before each try (the KV router
        hashes a long prompt without holding the loop).  ``trace``: the route span, parent of a ``queue``
        span when the request waits for a worker with room."""
        client, queue = self.client, self.queue
        deadline = None  # of the wait for a worker with room
        while True:
            await _ensure_instances(client)
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + queue.timeout
            wait = getattr(client, "wait_for_capacity", None)
            if wait is not None:
                if trace is not None and client.must_wait():
                    room = await _queued(trace, client, wait(deadline, queue.size))
                else:
                    room = await wait(deadline, queue.size)
                if not room:
                    raise ServiceUnavailableError(BUSY_MESSAGE, retry_after=queue.retry_after, overload=True)
            if prepare is not None:
                await prepare()
            try:
                stream = open_stream()
                await stream.start()
                return stream
            except RuntimeConnectionError:
                raise ServiceUnavailableError(UNREACHABLE_MESSAGE, retry_after=queue.retry_after) from None
            except WorkerBusyError:
                continue  # that worker is full (other frontends' requests): it is skipped for a moment
            except NoRespondersError as e:
                # the client marked that instance down; nothing reached a worker, so retrying is safe
                self.no_responders += 1
                if self.no_responders <= MAX_NO_RESPONDER_RETRIES:
                    log.info("request %s: %s; sending it to another worker", self.request_id, e)
                    if self.observer is not None:
                        self.observer.migrated("new_request")
                    continue
                raise ServiceUnavailableError(NO_WORKER_MESSAGE) from None
            except NoInstancesError:
                raise ServiceUnavailableError(NO_WORKER_MESSAGE) from None
            except InstanceNotFoundError as e:  # a request for a given instance (nvext.backend_instance_id)
                raise RequestError(str(e), status=400, param="nvext.backend_instance_id") from None


async def _queued(trace: tracing.Span, client: Any, waiting: Awaitable[bool]) -> bool:
    """A traced request's wait in the queue for a worker with room, as a ``queue`` span under its route:
    how many waited before it, and whether it got a worker (a full queue or the timeout fail the span)."""
    span = tracing.start_span("queue", trace, attributes={"dynamo.queue.ahead": client.queued()})
    room = False
    try:
        room = await waiting
        return room
    finally:
        if span is not None:
            span.set_attribute("dynamo.queue.admitted", room)
            if not room:
                tracing.fail(span, BUSY_MESSAGE)
            span.end()


async def _ensure_instances(client: Any) -> None:
    if client.instance_ids():
        return
    try:
        await client.wait_for_instances(timeout=INSTANCE_WAIT_S)
    except asyncio.TimeoutError:
        raise ServiceUnavailableError(NO_WORKER_MESSAGE) from None


class RemoteCoreEngine:
    kind = "core"

    def __init__(self, client: Any, router: RouterPolicy, *, migration_limit: int = 0,
                 queue: QueuePolicy | None = None, observer: Any = None):
        self.client = client
        self.router = router
        self.migration_limit = migration_limit
        self.queue = queue or QueuePolicy()
        # the frontend's metrics for this model (dynamo.frontend.worker_metrics.ModelObserver), or None
        self.observer = observer

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        attempts_left = self.migration_limit
        drains_left = MAX_DRAIN_RESUMES
        rt_ctx = RtContext(context.id)
        _link(context, rt_ctx)
        first = True
        observer = self.observer
        starts = WorkerStarts(self.client, self.queue, observer, context.id)
        router, client = self.router, self.client
        prepare = getattr(router, "prepare", None)
        trace = context.trace  # the request's server span (runtime/tracing.py); None: tracing off
        migrated_from: int | None = None
        migrations = 0
        migrating_since: float | None = None  # a stream lost mid-way: when (its migration's duration)
        produced = 0  # tokens generated over every attempt (the router's output length)
        try:
            while True:  # once, and once more per migration
                route = _route_span(trace, migrations) if trace is not None else None
                rt_ctx.trace = route  # the request-plane span, and so the worker's spans, are its children
                try:
                    stream = await starts.start(lambda: router.open(client, request, rt_ctx),
                                                None if prepare is None else lambda: prepare(request), route)
                except BaseException as exc:
                    if route is not None:
                        tracing.fail(route, str(exc) or type(exc).__name__)
                        route.end()
                    if migrating_since is not None and observer is not None:
                        observer.migration_done("ongoing_request", False, time.monotonic() - migrating_since)
                    raise
                if migrating_since is not None and observer is not None:
                    observer.migration_done("ongoing_request", True, time.monotonic() - migrating_since)
                migrating_since = None
                if route is not None:
                    _routed(trace, route, stream.instance_id, request.estimated_prefix_hit_num_blocks, migrated_from)
                # per-worker last TTFT / ISL / ITL: a timestamp at the first item, a count per item
                timing = observer.request(stream.instance_id, len(request.token_ids)) if observer is not None else None
                generated: list[int] = []  # this attempt's tokens: a resumed request carries them
                try:
                    async for item in stream:
                        # a Dynamo 1.x worker's LLMEngineOutput (usage and cached tokens in completion_usage)
                        out = (engine_output_from_v1(item) if V1_OUTPUT_KEY in item
                               else EngineOutput.from_dict(item))
                        generated += out.token_ids
                        if timing is not None and timing.first_at is None:
                            timing.first()
                        if first:
                            first = False
                            self.router.first_token(context.id)
                            if trace is not None:
                                trace.add_event("first_token")
                        if out.prompt_logprobs is not None:  # received: another worker need not compute them
                            request.output_options = msgspec.structs.replace(request.output_options,
                                                                             prompt_logprobs=None)
                        yield out
                        if out.finish_reason is not None:
                            return
                    return
                except WorkerDrainedError:
                    # the worker is shutting down and handed the request back: resumed elsewhere whatever
                    # the migration limit (nothing went wrong with the request itself)
                    if drains_left > 0 and not context.is_stopped:
                        drains_left -= 1
                        log.info("request %s: worker %s is draining; resuming it on another worker",
                                 context.id, stream.instance_id)
                        if observer is not None:
                            observer.migrated("ongoing_request")
                        migrating_since = time.monotonic()
                        _resume_after(request, generated)
                        migrated_from, migrations = stream.instance_id, migrations + 1
                        continue
                    raise LlmEngineError(STREAM_INCOMPLETE_MESSAGE) from None
                except StreamIncompleteError as e:
                    if attempts_left > 0 and not context.is_stopped:
                        attempts_left -= 1
                        log.warning("request %s: worker %s went away mid-stream; migrating (%d attempt(s) left)",
                                    context.id, stream.instance_id, attempts_left)
                        if observer is not None:
                            observer.migrated("ongoing_request")
                        migrating_since = time.monotonic()
                        _resume_after(request, generated)
                        migrated_from, migrations = stream.instance_id, migrations + 1
                        continue
                    if self.migration_limit > 0:
                        raise LlmEngineError("Migration limit exhausted: " + str(e)) from None
                    raise LlmEngineError(str(e)) from None
                except RtEngineError as e:
                    raise LlmEngineError(str(e)) from None
                finally:
                    produced += len(generated)  # (once per attempt, not per item)
                    if timing is not None:
                        timing.done(len(generated))
                    await stream.aclose()
        finally:
            self.router.finished(context.id, produced)


def _hex(instance_id: int | None) -> str:
    return f"{(instance_id or 0) & 0xFFFFFFFFFFFFFFFF:x}"


def _route_span(trace: tracing.Span, migrations: int) -> tracing.Span | None:
    """The span of one choice of a worker (queue, KV scoring, send and ack): the first, or a migration's."""
    return tracing.start_span("route", trace, attributes={"dynamo.migration.attempt": migrations})


def _routed(trace: tracing.Span, route: tracing.Span, worker: int | None, overlap: int | None,
            migrated_from: int | None) -> None:
    """A worker took the request: the route span names it and its cached prefix, and ends; a migration
    is an event on the request's span naming both workers."""
    route.set_attribute("dynamo.worker_id", _hex(worker))
    if overlap is not None:
        route.set_attribute("dynamo.kv.overlap_blocks", overlap)
    route.end()
    if migrated_from is not None:
        trace.add_event("migration", {"dynamo.migration.from_worker": _hex(migrated_from),
                                      "dynamo.migration.to_worker": _hex(worker)})


def _resume_after(request: PreprocessedRequest, generated: list[int]) -> None:
    """Make ``request`` the rest of itself once ``generated`` is delivered: prompt plus those tokens, that
    many fewer to go, and the next worker's parser told how many it resumes after."""
    if not generated:
        return
    request.token_ids = request.token_ids + generated
    # replaced, not mutated: the n choices of one request share these structs
    if request.parsing is not None:  # the next worker's parser catches up on them
        request.parsing = msgspec.structs.replace(
            request.parsing, resumed_tokens=(request.parsing.resumed_tokens or 0) + len(generated))
    sc = request.stop_conditions
    if sc.max_tokens is not None:
        request.stop_conditions = msgspec.structs.replace(sc, max_tokens=max(0, sc.max_tokens - len(generated)))


class RemoteChatEngine:
    """Forwards OpenAI requests (as the client sent them) to Chat/Completion workers, round-robin."""

    kind = "full"
    wants_raw_request = True

    def __init__(self, client: Any, queue: QueuePolicy | None = None, observer: Any = None):
        self.client = client
        self.queue = queue or QueuePolicy()
        self.observer = observer  # counts migrations (dynamo.frontend.worker_metrics.ModelObserver), or None

    async def generate(self, request: Any, context: Context, raw: dict[str, Any] | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        request = raw if raw is not None else request
        rt_ctx = RtContext(context.id)
        _link(context, rt_ctx)
        starts = WorkerStarts(self.client, self.queue, self.observer, context.id)
        # lazy: the chunks' JSON passes through to the SSE writer undecoded (dynamo/lazyjson.py)
        stream = await starts.start(lambda: self.client.round_robin(request, context=rt_ctx, lazy=True))
        try:
            async for chunk in stream:
                if type(chunk) is LazyJson and chunk.raw is not None and USAGE_KEY not in chunk.raw:
                    # the common chunk, answered from its bytes: a token when it has choices
                    if chunk.has_items("choices"):
                        context.completion_tokens += 1
                    yield chunk
                    continue
                usage = chunk.get("usage") if isinstance(chunk, dict) else None
                if usage:
                    context.prompt_tokens = usage.get("prompt_tokens", 0)
                    context.completion_tokens = usage.get("completion_tokens", 0)
                elif type(chunk) is LazyJson:
                    if chunk.has_items("choices"):  # from the bytes: no decoding per token
                        context.completion_tokens += 1
                elif isinstance(chunk, dict) and chunk.get("choices"):
                    context.completion_tokens += 1
                yield chunk
        except RtEngineError as e:
            raise LlmEngineError(str(e)) from None
        finally:
            await stream.aclose()
