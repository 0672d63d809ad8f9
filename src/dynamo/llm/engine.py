"""The one engine interface: ``generate(request, context) -> async iterator``.

Core engines (``kind = "core"``) take a :class:`PreprocessedRequest` and yield :class:`EngineOutput`
token items; full engines (``kind = "full"``) take an OpenAI request and yield OpenAI chunk dicts.  The
:class:`Context` carries the request id and cancellation both ways: the consumer calls
``stop_generating()`` (a stop condition fired, or the client went away) and the engine checks
``is_stopped`` or awaits ``stopped()`` to end its work early.

Everything else an engine may do is optional and typed here: each optional behaviour is a ``Protocol``
(start, close, publish KV events and load metrics, export and import sequence state, ...), and
:func:`capabilities_of` checks them once, when the served model is built, into an
:class:`EngineCapabilities` record that the pipeline builder and the worker read.  Engines declare the
sampling features they honour as class attributes (``guided_decoding``, ``logit_bias``, ``logprobs``,
``prompt_logprobs``); nothing else probes an engine's attributes.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, runtime_checkable


class PhaseReport(Protocol):
    """What an engine may tell of a traced request's phases (the worker records them as spans).

    Engines that know when their scheduler admits a request call :meth:`admitted` (the worker's
    ``queue`` span ends and ``prefill`` starts there); a disaggregated decode calls :meth:`kv_transfer`
    once the prefill worker's KV state is fetched (or the fetch failed).  Each call is cheap (a
    timestamp, or one finished span) and engines call it only when ``context.phases`` is set."""

    def admitted(self) -> None: ...

    def kv_transfer(self, started_ns: int, n_bytes: int, n_tokens: int, blocks: int | None,
                    error: str | None = None) -> None: ...


def phase_report(context: Any) -> PhaseReport | None:
    """The request's :class:`PhaseReport`, if it is traced (``context``: what the engine was given)."""
    return context.phases if isinstance(context, Context) else None


class Context:
    """Per-request state shared by the input, the pipeline stages and the engine."""

    __slots__ = ("id", "is_stopped", "_killed", "_event", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "annotations", "_callbacks", "stamps", "trace", "phases")

    def __init__(self, request_id: str | None = None):
        self.id = request_id or uuid.uuid4().hex
        # the engine asks per token: a plain attribute (a property was a Python call per token); only
        # ``stop_generating`` and ``kill`` set it
        self.is_stopped = False
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
        # the request's server span (runtime/tracing.py): the parent of its pre-processing and routing
        # spans; None when tracing is off
        self.trace: Any = None
        # a traced request on a worker: what the engine tells of its phases (admission, a KV transfer);
        # None when tracing is off or the request is not traced
        self.phases: PhaseReport | None = None

    def on_stop(self, callback: Any) -> None:
        """``callback("stop" | "kill")`` when the request is stopped or killed (transports hook in here)."""
        self._callbacks.append(callback)

    @property
    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        """Ask the engine to finish; what it already produced is still wanted."""
        if not self.is_stopped:
            self.is_stopped = True
            if self._event is not None:
                self._event.set()
            for cb in self._callbacks:
                cb("stop")

    def kill(self) -> None:
        """The consumer is gone: stop at once, nothing more will be read."""
        if self._killed:
            return
        self._killed = True
        if not self.is_stopped:
            self.is_stopped = True
            if self._event is not None:
                self._event.set()
        for cb in self._callbacks:
            cb("kill")

    async def stopped(self) -> None:
        """Wait until the request is stopped (for engines that wait on something else meanwhile)."""
        if self.is_stopped:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()


@runtime_checkable
class Engine(Protocol):
    kind: str  # "core" (token ids in and out) or "full" (OpenAI requests in, chunks out)

    def generate(self, request: Any, context: Context) -> AsyncIterator[Any]: ...


@runtime_checkable
class Startable(Protocol):
    """Loads weights or starts threads in ``start()``, awaited once before the first request."""

    def start(self) -> Awaitable[None] | None: ...


@runtime_checkable
class Closable(Protocol):
    """Holds threads, processes or sockets that ``close()`` (plain or a coroutine) releases."""

    def close(self) -> Awaitable[None] | None: ...


@runtime_checkable
class PublishesKvEvents(Protocol):
    """Tells the KV router what it caches and how busy it is (a worker attaches its publishers).

    ``publishes_kv_events`` may be False at run time (events turned off): the worker then publishes load
    metrics only and frontends route without prefix overlap for it.
    """

    def attach(self, worker_id: int, *, publish_kv_event: Callable[..., Any] | None = None,
               publish_metrics: Callable[..., Any] | None = None) -> None: ...

    @property
    def publishes_kv_events(self) -> bool: ...

    def all_load_metrics(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class DumpsKvState(Protocol):
    """Answers a router that joins late with every block it holds (the recovery endpoint: worker/kv_publishing.py)."""

    def kv_state_dump(self) -> dict[str, Any]: ...


@runtime_checkable
class HasCapacity(Protocol):
    """Says how many requests it runs at once (the worker's default ``--max-inflight``)."""

    @property
    def capacity(self) -> int: ...


@runtime_checkable
class HasRuntimeConfig(Protocol):
    """Publishes facts about itself with the model (KV blocks, slots) for frontends to route by."""

    @property
    def runtime_config(self) -> dict[str, Any]: ...


@runtime_checkable
class ExportsSequenceState(Protocol):
    """Can export a sequence's KV state after prefill and import it for decode (real disaggregation)."""

    supports_state_io: bool


@runtime_checkable
class LendsKvPrefixes(Protocol):
    """Exports the KV state of its cache sharing the longest prefix with a prompt, for another worker,
    and takes such a state in ``generate(..., prefix_state=...)``: a ``concurrent.futures.Future`` of one
    (or of None: compute the prompt), the request keeping its place in line until it is done
    (disagg/prefix_share.py)."""

    async def export_prefix(self, tokens: list[int]) -> tuple[int, int, Any] | None: ...

    def keep_states_to_lend(self) -> None:
        """From now on keep what it may lend where ``export_prefix`` reaches it without waiting for the
        engine's next step (called once a worker lends)."""


@runtime_checkable
class ServesLoraAdapters(Protocol):
    """Serves LoRA adapters of its model by name: a request whose ``model`` names a loaded adapter runs
    with it (llm/lora.py).  ``load_lora`` and ``unload_lora`` raise UserError for what the user got wrong
    (not an adapter of this model, a name taken or unknown)."""

    def lora_adapters(self) -> dict[str, str]: ...

    async def load_lora(self, name: str, path: str) -> None: ...

    async def unload_lora(self, name: str) -> None: ...


@runtime_checkable
class TakesImages(Protocol):
    """Sees images (``PreprocessedRequest.multi_modal_data``): ``image_tokens`` is how many placeholder
    positions an image takes in a prompt (0: this instance was started without an image encoder)."""

    @property
    def image_tokens(self) -> int: ...


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond ``generate``, checked once when the served model is built."""

    starts: bool = False
    closes: bool = False
    publishes_kv: bool = False  # attach / publishes_kv_events / all_load_metrics
    dumps_kv_state: bool = False
    capacity: int | None = None
    runtime_config: dict[str, Any] = field(default_factory=dict)
    state_io: bool = False
    guided_decoding: Any = False  # True, False, or the kinds it honours (see llm/constraints.py)
    logit_bias: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False
    wants_raw_request: bool = False  # full engines that read the client's JSON as sent
    # full engines given the JSON as sent that take a chat's images as image_url parts (checked data: URLs)
    image_urls: bool = False
    # full engines whose stream is the client's as it is: a usage chunk exactly when the request asks
    # for one (``include_usage``), so the pipeline passes it on without a layer of its own
    sends_usage: bool = False
    image_tokens: int = 0  # positions an image takes in a prompt (0: no images)


_SAMPLING_DEFAULTS = {"guided_decoding": False, "logit_bias": False, "logprobs": False, "prompt_logprobs": False,
                      "wants_raw_request": False, "image_urls": False, "sends_usage": False}


def capabilities_of(engine: object) -> EngineCapabilities:
    """The one place an engine's optional behaviours are looked up."""
    declared = {name: getattr(engine, name, default) for name, default in _SAMPLING_DEFAULTS.items()}
    return EngineCapabilities(
        starts=isinstance(engine, Startable),
        closes=isinstance(engine, Closable),
        publishes_kv=isinstance(engine, PublishesKvEvents),
        dumps_kv_state=isinstance(engine, DumpsKvState),
        capacity=engine.capacity if isinstance(engine, HasCapacity) else None,
        runtime_config=dict(engine.runtime_config or {}) if isinstance(engine, HasRuntimeConfig) else {},
        state_io=isinstance(engine, ExportsSequenceState) and bool(engine.supports_state_io),
        guided_decoding=declared["guided_decoding"],
        logit_bias=bool(declared["logit_bias"]),
        logprobs=bool(declared["logprobs"]),
        prompt_logprobs=bool(declared["logprobs"]) and bool(declared["prompt_logprobs"]),
        wants_raw_request=bool(declared["wants_raw_request"]),
        image_urls=bool(declared["wants_raw_request"]) and bool(declared["image_urls"]),
        sends_usage=bool(declared["sends_usage"]),
        image_tokens=int(engine.image_tokens) if isinstance(engine, TakesImages) else 0,
    )


async def start_engine(engine: object) -> None:
    """Run an engine's ``start`` (weights load there, off the event loop), if it has one."""
    if isinstance(engine, Startable):
        result = engine.start()
        if result is not None:
            await result


async def close_engine(engine: object) -> None:
    """Close an engine that holds resources; its ``close`` may be plain or a coroutine."""
    if isinstance(engine, Closable):
        result = engine.close()
        if result is not None:
            await result
