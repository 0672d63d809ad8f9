"""Echo engines: no model, deterministic output, for testing the whole serving path.

``echo_full`` echoes the last user message (chat) or the prompt (completions) one character per chunk;
``echo_core`` echoes the pre-processed prompt's token ids one per item, so it exercises templating,
tokenization and detokenization.  Both wait ``DYN_TOKEN_ECHO_DELAY_MS`` (default 10) between items,
against a deadline rather than a fixed sleep, so a busy server catches up instead of drifting.

``echo_core --embedding`` needs no weights: it tokenizes with the model's tokenizer and turns the token
ids into a fixed vector (a hashed bag of tokens with their positions, L2-normalised), so the same input
always gives the same vector, different inputs give different ones, and the usage counts are real
tokens.  It honours ``dimensions`` (a prefix of the vector, normalised again, as Matryoshka models do).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import weakref
from typing import Any, AsyncIterator

import orjson

from dynamo.errors import RequestError
from dynamo.lazyjson import LazyJson
from dynamo.llm.chunks import ChatChunks, CompletionChunks
from dynamo.llm.embeddings import EmbeddingInput, Embeddings
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    include_usage,
    last_user_text,
    max_tokens_of,
    prompt_text,
)
from dynamo.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_dumps = orjson.dumps
DEFAULT_DELAY_MS = 10.0


def echo_delay_seconds() -> float:
    raw = os.environ.get("DYN_TOKEN_ECHO_DELAY_MS")
    if raw is None:
        return DEFAULT_DELAY_MS / 1000
    try:
        value = float(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        log.warning("DYN_TOKEN_ECHO_DELAY_MS=%r is not a non-negative number; using %s", raw, DEFAULT_DELAY_MS)
        value = DEFAULT_DELAY_MS
    return value / 1000


class _Ticks:
    """One loop's paced items, grouped by the millisecond they fall due in: one loop timer per
    millisecond that has any, which resolves each of its futures in turn (with its item).

    Why: a loop timer per token is a timer handle, a timer-heap insert and removal and a Python callback
    when it fires; with 256 streams at 10 ms about 25 streams fall due in each millisecond, and they now
    share one (docs/performance.md, "CPU per token").  uvloop's timers count whole milliseconds anyway,
    so each token keeps its own deadline, as precise as before; tokio, under the original's echo engine,
    groups its timers the same way (a timer wheel).
    """

    __slots__ = ("due", "_later")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.due: dict[int, list[tuple[asyncio.Future[Any], Any]]] = {}
        self._later = loop.call_later

    def add(self, tick: int, fut: "asyncio.Future[Any]", value: Any, pause: float) -> None:
        """Resolve ``fut`` with ``value`` at millisecond ``tick``, which is ``pause`` seconds away."""
        self.due[tick] = [(fut, value)]
        self._later(pause, self._fire, tick)

    def _fire(self, tick: int) -> None:
        for fut, value in self.due.pop(tick):
            try:
                fut.set_result(value)
            except asyncio.InvalidStateError:  # cancelled meanwhile (the client left)
                pass


_TICKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ticks]" = weakref.WeakKeyDictionary()


class _Pacer:
    """When each item is due; with no delay, a turn of the loop now and then for fairness.

    An item that is already overdue (the loop was busy) goes out at once, without a turn of the loop
    in between: the items that fell due together leave together, in one frame batch and one write,
    as a real engine's queued tokens do, so a busy server catches up cheaply instead of paying a
    full loop turn and a send per late token.  On an idle loop every item waits for its own deadline
    (:class:`_Ticks`), so each token is its own event and its own write.

    ``at_due(item)`` hands back a future that the item's deadline resolves with the item, rather than
    being a coroutine around ``asyncio.sleep``: no frames of its own while it waits, and no
    ``get_running_loop`` (a ``getpid`` system call on Python 3.11) per token.
    """

    __slots__ = ("delay", "_due", "_n", "_create", "_ticks", "_due_at", "_loop")

    def __init__(self, delay: float):
        self.delay = delay
        self._due = time.monotonic()
        self._n = 0
        loop = self._loop = asyncio.get_running_loop()
        self._create = loop.create_future
        ticks = _TICKS.get(loop)
        if ticks is None:
            ticks = _TICKS[loop] = _Ticks(loop)
        self._ticks = ticks
        self._due_at = ticks.due

    def at_due(self, item: Any) -> "asyncio.Future[Any]":
        """A future resolved with ``item`` when it is due (already resolved when it is due now)."""
        fut = self._create()
        if self.delay > 0:
            due = self._due = self._due + self.delay
            pause = due - time.monotonic()
            if pause > 0:
                tick = int(due * 1000 + 0.5)
                waiting = self._due_at.get(tick)
                if waiting is None:
                    self._ticks.add(tick, fut, item, pause)
                else:
                    waiting.append((fut, item))
                return fut
        else:
            self._n += 1
            if not self._n % 16:
                self._loop.call_soon(_wake, fut, item)
                return fut
        fut.set_result(item)
        return fut


def _wake(fut: "asyncio.Future[Any]", item: Any) -> None:
    if not fut.done():  # not cancelled meanwhile (the client left)
        fut.set_result(item)


class EchoFullEngine:
    """Echoes the last user message (or the prompt) one character per chunk.

    Its stream is what the client gets (``sends_usage``): the usage chunk when the request asks for
    it, so the pipeline adds no layer of its own.
    """

    kind = "full"
    sends_usage = True

    def __init__(self, delay: float | None = None):
        self.delay = echo_delay_seconds() if delay is None else delay

    def generate(self, request: ChatCompletionRequest | CompletionRequest, context: Context) -> AsyncIterator[dict[str, Any]]:
        return _EchoStream(request, context, self.delay)


class _EchoStream(_Pacer):
    """One echo_full answer, as an async iterator whose ``__anext__`` hands back a future of the next
    chunk, which the chunk's deadline resolves (:class:`_Pacer`).

    Why not an async generator: each token was two resumptions of its frame (one to start the wait, one
    to yield the chunk) and a call to the pacer; here it is one call, and the SSE writer, which awaits
    a future it is handed directly, takes the chunk from it.  After the first chunk (the role's) each
    chunk is rendered from the stream's byte template (``text_template``) as a :class:`LazyJson`, which
    the SSE writer sends as it is and any other reader decodes: one string encoded per token instead of
    a nested dict built and encoded.  Every token still has its own deadline, its own event and, when
    the loop keeps up, its own write.
    """

    __slots__ = ("_request", "_ctx", "_text", "_i", "_end", "_reason", "_chunks", "_prefix", "_suffix")

    def __init__(self, request: ChatCompletionRequest | CompletionRequest, context: Context, delay: float):
        # (the pacer's loop state is set with the first chunk: the stream may be made before the loop runs)
        self.delay = delay
        self._request = request
        self._ctx = context
        self._text = ""
        self._i = -1  # -1: not started; then the index of the next character
        self._end = 0  # how many characters are sent
        self._reason = "stop"

    def __aiter__(self) -> "_EchoStream":
        return self

    def __anext__(self) -> "asyncio.Future[Any]":
        i = self._i
        if 0 < i < self._end and not self._ctx.is_stopped:  # a token after the first: the per-token path
            self._i = i + 1
            self._ctx.completion_tokens = i + 1
            item = LazyJson(self._prefix + _dumps(self._text[i]) + self._suffix)
            if self.delay > 0:  # at_due, inline (a call less per token)
                fut = self._create()
                due = self._due = self._due + self.delay
                pause = due - time.monotonic()
                if pause > 0:
                    tick = int(due * 1000 + 0.5)
                    waiting = self._due_at.get(tick)
                    if waiting is None:
                        self._ticks.add(tick, fut, item, pause)
                    else:
                        waiting.append((fut, item))
                else:
                    fut.set_result(item)
                return fut
            return self.at_due(item)
        return self._other()

    def _other(self) -> "asyncio.Future[Any]":
        """The first chunk, or the end: the last chunk (its finish reason) and the usage, when asked."""
        i = self._i
        if i < 0:
            self._start()
            i = 0
        if i < self._end and self._ctx.is_stopped:
            self._end, self._reason = i, "stop"
        if i < self._end:
            self._i = 1
            self._ctx.completion_tokens = 1
            return self.at_due(self._chunks.delta(self._text[0]))
        self._i = i + 1
        fut = self._create()
        if i == self._end:
            fut.set_result(self._chunks.delta(None, self._reason))
        elif i == self._end + 1 and include_usage(self._request):
            fut.set_result(self._chunks.usage(self._ctx.prompt_tokens, self._end))
        else:
            self._i = i  # (over: stays over)
            raise StopAsyncIteration
        return fut

    def _start(self) -> None:
        request, context = self._request, self._ctx
        if request.logprobs or (isinstance(request, CompletionRequest) and request.logprobs is not None):
            # an echo has no distribution: made-up numbers or ``null`` would both be lies
            raise RequestError("logprobs: the echo engine has no token probabilities", param="logprobs")
        _Pacer.__init__(self, self.delay)
        if isinstance(request, ChatCompletionRequest):
            text = last_user_text(request)
            self._chunks: ChatChunks | CompletionChunks = ChatChunks(request.model, context.id)
        else:
            text = prompt_text(request.prompt)
            self._chunks = CompletionChunks(request.model, context.id)
        context.prompt_tokens = len(text)  # no tokenizer: a character counts as a token
        limit = max_tokens_of(request)
        if limit is not None and limit < len(text):
            self._reason = "length"
            text = text[:limit]
        self._text = text
        self._end = len(text)
        self._prefix, self._suffix = self._chunks.text_template()

    async def aclose(self) -> None:
        """Nothing more will be asked: the stream is over (the futures handed out stay as they are)."""
        if self._i < 0:
            self._i = 0
        self._end = min(self._end, self._i)
        self._i = self._end + 2  # past the last chunk and the usage


class EchoCoreEngine:
    kind = "core"

    def __init__(self, delay: float | None = None):
        self.delay = echo_delay_seconds() if delay is None else delay

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        pacer = _Pacer(self.delay)
        for token_id in request.token_ids:
            if context.is_stopped:
                return
            await pacer.at_due(None)
            yield EngineOutput(token_ids=[token_id])
        yield EngineOutput(token_ids=[], finish_reason="stop")


ECHO_DIMENSIONS = 32


class EchoEmbeddingEngine:
    kind = "embedding"

    def __init__(self, card: ModelCard, dimensions: int = ECHO_DIMENSIONS):
        self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
        self.dimensions = dimensions

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        if dimensions is not None and dimensions > self.dimensions:
            raise RequestError(f"dimensions must be at most {self.dimensions} for this model", param="dimensions")
        size = dimensions or self.dimensions
        vectors, total = [], 0
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else item
            total += len(ids)
            vectors.append(echo_vector(ids, self.dimensions)[:size])
            await asyncio.sleep(0)
        return Embeddings([_normalised(v) for v in vectors], total)


def echo_vector(ids: list[int], dimensions: int) -> list[float]:
    """The echo engine's vector for ``ids`` (unnormalised): each token adds a pseudo-random +-1 pattern."""
    vec = [0.0] * dimensions
    for pos, tok in enumerate(ids):
        h = (tok * 2654435761 + pos * 40503 + 1) & 0xFFFFFFFF
        for j in range(dimensions):
            h = (h * 1103515245 + 12345) & 0x7FFFFFFF
            vec[j] += 1.0 if h & 0x10000 else -1.0
    return vec


def _normalised(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vec))
    return [v / norm for v in vec] if norm > 0 else vec
