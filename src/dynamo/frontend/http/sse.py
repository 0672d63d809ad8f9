"""The one SSE writer: chat, completions and responses streams all leave through :func:`stream_sse`.

The first item is awaited before the response is committed, so a request that fails at the start gets a
proper status code instead of a broken stream.  What the events look like is the route's
(:class:`SseFormat`: OpenAI chunks and ``[DONE]`` here, :class:`ChunkEvents`; the Responses API's typed
events in responses.py); how they are written is this module's, the same for every stream:

* After its first item a stream runs as its own task (the pump): a token then wakes a short chain of
  frames (the pump and the pipeline beneath it) instead of aiohttp's request handler, the middlewares
  and the route handler as well, about ten frame resumptions per token.  Cancelling the handler (the
  client left) cancels it.
* Every item that is ready when the pump looks leaves in one write: a paced stream still sends each
  token as it comes, and a stream that fell behind catches up with one send per batch (at most
  ``SSE_BATCH`` events, then the other streams get a turn).
* The headers leave with the first events, in one ``send`` (:class:`SseResponse`), and after them
  events go straight to the transport as HTTP chunks (:class:`ChunkSink`).
* An error mid-stream ends the body with the format's error event; a client that left kills the
  request's context, which stops the engine's work.

Measured on the per-token path (docs/performance.md, "Where the 31 µs per token went"): 54 Python
calls per token before the pump, the inline ``__anext__`` calls and the direct writes, 33 after; CPU
per token at 64 streams 34-37 µs instead of 50-56 µs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Protocol

import orjson
from aiohttp import web

from dynamo.aio import abandon, finish
from dynamo.errors import EngineError, RequestError
from dynamo.frontend.http.errors import error_body
from dynamo.frontend.http.metrics import RequestMetrics
from dynamo.lazyjson import LazyJson
from dynamo.llm import first_token
from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context

log = logging.getLogger(__name__)
Future = asyncio.Future  # what a paced engine's wait yields (uvloop's and asyncio's futures alike)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
SSE_BATCH = 256  # events at most in one write when a stream has a backlog
DONE = b"data: [DONE]\n\n"
DRAIN_EVERY = 0x10000  # aiohttp's own LIMIT: bytes between two flow-control checks of a stream


class SseFormat(Protocol):
    """What a stream's events look like; the writer calls ``item`` once per item (the per-token path)."""

    def item(self, item: Any) -> bytes:
        """One item's events (b"" for none); called once per item, on the per-token path."""
        ...

    def begin(self) -> list[bytes]:
        """A fresh list with the events that go before the first item's."""
        ...

    def end(self) -> bytes:
        """The events after the last item of a stream that completed."""
        ...

    def failed(self, message: str, status: int) -> bytes:
        """The events that end a stream that failed after its headers were sent."""
        ...


# Characters JSON may leave raw that Python's str.splitlines() takes for line ends, and with it httpx's
# iter_lines(), which many Python clients read SSE with: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR. A token
# that decodes to one cut the event in two for such a client (seen: a mocker's random tokens made a test's
# json.loads fail on half an event). Escaped, the JSON means the same to every parser.
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def line_safe(data: bytes) -> bytes:
    """``data`` (JSON) with the characters above escaped; itself when it has none. ASCII first: most chunks
    are, and ``isascii`` is one fast pass (the two searches alone were 1.8 % of the frontend's samples at 64
    streams on a mocker's tokens, py-spy)."""
    if data.isascii():
        return data
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKERS:
            data = data.replace(raw, escaped)
    return data


def chunk_event(item: Any, dumps: Callable[[Any], bytes] = orjson.dumps) -> bytes:
    """One chunk of the chat or completions stream as its SSE event (an annotation as a named event)."""
    if type(item) is dict:
        return b"data: " + line_safe(dumps(item)) + b"\n\n"
    if type(item) is LazyJson:  # a remote worker's chunk: its own bytes when nothing changed it
        raw = item.raw
        return b"data: " + line_safe(raw if raw is not None else dumps(dict(item.items()))) + b"\n\n"
    if isinstance(item, Annotation):
        return b"event: " + item.name.encode() + b"\n: " + line_safe(dumps(item.value)) + b"\n\n"
    return b""


class ChunkEvents:
    """The OpenAI chat and completions stream: ``data: <chunk>`` events, then ``data: [DONE]``; an error
    mid-stream is a ``data: {"error": ...}`` event before the ``[DONE]``."""

    item = staticmethod(chunk_event)

    def begin(self) -> list[bytes]:
        return []

    def end(self) -> bytes:
        return DONE

    def failed(self, message: str, status: int) -> bytes:
        return b"data: " + error_body(message, status) + b"\n\n" + DONE


CHUNK_EVENTS = ChunkEvents()


class SseResponse(web.StreamResponse):
    """An SSE response whose headers leave with its first events, in one ``send``.

    ``prepare()`` is called once the first item is already there, so nothing waits for the headers;
    aiohttp's own ``web.Response`` buffers them the same way (this flag is how it does; an aiohttp
    without it simply sends them at once). One ``send`` less per request: the header write was 12 % of
    the py-spy samples of a frontend serving short requests (docs/performance.md).
    """

    _send_headers_immediately = False


class ChunkSink:
    """Writes a streaming response's events straight to the connection once its headers are out.

    Why not ``StreamResponse.write`` for every event: per event it is four Python calls (the response's
    and the writer's ``write``, ``_write_chunked_payload``, ``_writelines``), an f-string and a join;
    with 256 paced streams on an idle machine each token is its own write, and that wrapper was 6 to
    10 % of the py-spy samples of the server (docs/performance.md).  The first write still goes through
    aiohttp (the buffered headers leave with it) and so does the last (``write_eof``); flow control is
    aiohttp's own (its writer's ``drain`` every 64 KiB, as its ``write`` does).  Anything unusual (no
    payload writer, compression, a transport that is gone) takes aiohttp's path.
    """

    __slots__ = ("_resp", "_request", "_transport", "_writer", "_chunked", "_since_drain")

    def __init__(self, resp: web.StreamResponse, request: web.Request):
        self._resp = resp
        self._request = request
        self._transport: asyncio.Transport | None = None
        self._writer: Any = None
        self._chunked = True
        self._since_drain = 0

    def write(self, parts: list[bytes]) -> Any:
        """Send the gathered events (``parts`` is emptied); returns an awaitable when the caller must wait."""
        data = b"".join(parts) if len(parts) > 1 else parts[0]
        parts.clear()
        transport = self._transport
        if transport is None:
            return self._first(data)
        if transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        n = len(data)
        transport.write(b"%x\r\n%b\r\n" % (n, data) if self._chunked else data)
        self._since_drain += n
        if self._since_drain > DRAIN_EVERY:
            self._since_drain = 0
            return self._writer.drain()
        return None

    async def _first(self, data: bytes) -> None:
        resp = self._resp
        await resp.write(data)
        writer = getattr(resp, "_payload_writer", None)
        if (writer is not None and getattr(writer, "_compress", None) is None
                and not getattr(writer, "_headers_buf", None) and resp.compression is False):
            self._writer = writer
            self._chunked = bool(writer.chunked)
            self._transport = self._request.transport


async def stream_sse(request: web.Request, stream: AsyncIterator[Any], ctx: Context, rm: RequestMetrics,
                     fmt: SseFormat = CHUNK_EVENTS,
                     headers: dict[str, str] | None = None,
                     split_first: Callable[[Any], list[Any]] | None = None) -> tuple[web.StreamResponse, bool]:
    """Stream ``stream`` as SSE in ``fmt``; the response and whether the stream completed without error.

    ``stream`` is closed in every case; ``rm`` counts its tokens as they are written; ``headers`` are
    the route's own, sent with the SSE ones; ``split_first`` turns the first item into the events it
    stands for (the chat route's role-only opening chunk).
    """
    # the first item before committing to 200: start-up failures get a real status code
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    else:
        rm.tokens(ctx.completion_tokens, ctx.prompt_tokens, ctx.cached_tokens)
    first_token.stamp(ctx.stamps, "first item")
    resp = SseResponse(status=200, headers={**SSE_HEADERS, **headers} if headers else SSE_HEADERS)
    try:
        await resp.prepare(request)
    except (ConnectionResetError, ConnectionError):
        ctx.kill()
        await stream.aclose()  # type: ignore[attr-defined]
        log.debug("request %s: client went away before the response started", ctx.id)
        return resp, False
    firsts = None if first is None else split_first(first) if split_first is not None else [first]
    pump = asyncio.get_running_loop().create_task(_pump(resp, request, stream, ctx, rm, firsts, fmt))
    return resp, await pump


async def _pump(resp: web.StreamResponse, request: web.Request, stream: AsyncIterator[Any], ctx: Context,
                rm: RequestMetrics, firsts: list[Any] | None, fmt: SseFormat) -> bool:
    """Write the stream's items as SSE events; whether it ended without error.

    Each ``__anext__`` call is started here, to see whether its item is ready without waiting for it
    (``aio.next_now`` does the same through a helper object: two Python calls more per token, on the
    per-token path of every stream).  When the call waits on a future (a paced engine's timer, a queue's
    getter: nearly always), the pump hands the future back to it and awaits the call itself: resumed,
    the future's ``await`` yields it again, this time to the task (asyncio's C future does so when it is
    marked as not yet taken, which is what a task does when it takes one), and the item, a further wait,
    a failure or a cancellation then pass natively, as under ``await stream.__anext__()``.  Anything else
    it yielded goes through ``aio.finish``, which relays it.  A stream whose ``__anext__`` returns a
    future (echo_full) is awaited on that future directly.  Against relaying every wait through
    ``finish``: no generator frame and no ``StopIteration`` caught in Python per token
    (docs/performance.md).
    """
    encode = fmt.item
    tokens = rm.tokens
    sink = ChunkSink(resp, request)
    parts = fmt.begin()
    step: Any = None  # an ``__anext__`` call that had to wait and is not finished
    ok = gone = False
    try:
        if firsts is not None:
            for first in firsts:
                data = encode(first)
                if data:
                    parts.append(data)
            anext = stream.__anext__
            in_a_row = 0
            while True:
                nxt: Any = anext()
                if type(nxt) is Future:  # a stream that hands out the future of its item (echo_full)
                    call = None
                    ready = nxt.done()
                    if ready:
                        item = nxt.result()
                else:
                    call = nxt.__await__()  # an async generator's asend object itself
                    try:
                        signal = call.send(None)
                    except StopIteration as done:
                        item = done.value
                        ready = True
                    except StopAsyncIteration:
                        break
                    else:
                        ready = False
                if ready:
                    in_a_row += 1
                else:
                    # not ready: what was gathered leaves now, then wait for the item as the task would
                    in_a_row = 0
                    step = call  # a failed write (or a cancellation) must end the call it interrupted
                    if parts:
                        w = sink.write(parts)
                        if w is not None:
                            await w
                        if ctx.stamps is not None:
                            first_token.report(ctx)
                    step = None
                    if call is None:
                        item = await nxt
                    elif type(signal) is Future:
                        # the usual wait (a paced engine's timer, a queue): the future goes back to the
                        # call's own ``await``, which yields it again when resumed, now to the task
                        signal._asyncio_future_blocking = False
                        item = await call
                    else:  # anything else it yielded: relayed by aio.finish
                        item = await finish(call, signal)
                tokens(ctx.completion_tokens, ctx.prompt_tokens, ctx.cached_tokens)
                data = encode(item)
                if data:
                    parts.append(data)
                    if in_a_row >= SSE_BATCH:  # a long backlog: let the other streams have a turn
                        in_a_row = 0
                        w = sink.write(parts)
                        if w is not None:
                            await w
                        await asyncio.sleep(0)
        ok = True
    except StopAsyncIteration:  # the stream ended while an item was awaited
        ok = True
    except (EngineError, RequestError) as e:
        log.warning("request %s failed mid-stream: %s", ctx.id, e)
        parts.append(fmt.failed(str(e), e.status if isinstance(e, RequestError) else 500))
    except (ConnectionResetError, ConnectionError):
        ctx.kill()
        log.debug("request %s: client went away", ctx.id)
        gone = True
    except Exception as e:  # our bug: the headers are out, so end the stream cleanly rather than cut it
        log.exception("request %s: internal error mid-stream", ctx.id)
        parts.append(fmt.failed(f"Internal server error: {type(e).__name__}: {e}", 500))
    finally:
        if step is not None:  # a write failed (or we were cancelled) while an item was awaited
            await abandon(step)
        await stream.aclose()  # type: ignore[attr-defined]
    if gone:
        return False
    if ok:
        parts.append(fmt.end())
    try:
        await resp.write_eof(b"".join(parts))  # the last events and the end of the body: one send
        first_token.report(ctx)  # (a stream that was whole before its first write)
    except (ConnectionResetError, ConnectionError):  # the client left as its stream ended: not our error
        log.debug("request %s: client went away before the end of the stream", ctx.id)
        return False
    return ok
