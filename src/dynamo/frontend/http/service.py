"""The OpenAI-compatible HTTP service (aiohttp).

One request flow for chat and completions: parse JSON -> validate -> find the model -> start the
pipeline -> stream SSE or fold into one response.  The first item is awaited before the response is
committed, so a request that fails at the start gets a proper status code instead of a broken stream.
A client that disconnects cancels the handler (``handler_cancellation``), which closes the pipeline and
stops the engine's work.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, AsyncIterator, Callable

import orjson
from aiohttp import web

from dynamo.aio import Acceptor, abandon, finish
from dynamo.errors import EngineError, RequestError, ServiceUnavailableError
from dynamo.frontend.http.api_routes import register_api_routes
from dynamo.frontend.http.errors import error_body, error_response, request_error_response
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.options import BODY_LIMIT_KEY, HttpOptions
from dynamo.frontend.model_manager import ModelManager
from dynamo.lazyjson import LazyJson
from dynamo.llm import first_token
from dynamo.llm.aggregate import fold_chat, fold_completion
from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # a burst of hundreds of new connections must not overflow the accept queue
DEFAULT_MAX_INFLIGHT = 1024  # --max-inflight on in=http: requests in progress (generating or queued) at once
_DONE = b"data: [DONE]\n\n"
SSE_BATCH = 256  # events at most in one write when a stream has a backlog
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


class _SseResponse(web.StreamResponse):
    """An SSE response whose headers leave with its first events, in one ``send``.

    ``prepare()`` is called once the first item is already there, so nothing waits for the headers;
    aiohttp's own ``web.Response`` buffers them the same way (this flag is how it does; an aiohttp
    without it simply sends them at once). One ``send`` less per request: the header write was 12 % of
    the py-spy samples of a frontend serving short requests (docs/performance.md).
    """

    _send_headers_immediately = False


class _ChunkSink:
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

    DRAIN_EVERY = 0x10000  # aiohttp's own LIMIT: bytes between two flow-control checks

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
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        self._since_drain += len(data)
        if self._since_drain > self.DRAIN_EVERY:
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


class HttpService:
    def __init__(self, models: ModelManager, *, metrics: FrontendMetrics | None = None,
                 max_inflight: int = DEFAULT_MAX_INFLIGHT, options: HttpOptions | None = None):
        self.models = models
        self.max_inflight = max_inflight
        self._admitted = 0
        self.metrics = metrics or FrontendMetrics()
        self.options = options or HttpOptions()
        self.app = web.Application(client_max_size=self.options.body_limit,
                                   middlewares=[*self.options.middlewares(), _error_middleware])
        self.app[BODY_LIMIT_KEY] = self.options.body_limit
        self.options.install(self.app)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/live", self.live)
        self.app.router.add_get("/metrics", self.prometheus)
        register_api_routes(self)  # embeddings, responses, tokenize (their own modules)
        self._runner: web.AppRunner | None = None
        self._acceptor: Acceptor | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        self._contexts: set[Context] = set()
        self.port: int | None = None

    # -- lifecycle
    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        sock = _listen_socket(host, port)
        # our own accept loop: 256 clients connecting at once are accepted in one turn, not one per turn
        self._acceptor = Acceptor(sock, self._runner.server, ssl=self.options.ssl_context())  # type: ignore[arg-type]
        self.port = sock.getsockname()[1]
        log.info("OpenAI-compatible HTTP service listening on %s://%s:%d", self.options.scheme, host, self.port)
        self.metrics.prepare_in_background()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, give in-flight requests ``grace`` seconds to finish, then end them."""
        if self._runner is None:
            return
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        if self._inflight:
            log.info("waiting up to %gs for %d in-flight request(s)", grace, len(self._inflight))
            _, pending = await asyncio.wait(list(self._inflight), timeout=grace)
            if pending:
                # out of patience: stop the engines, so each stream still ends with its finish chunk and
                # [DONE] (a unary request gets what was generated) instead of a cut connection
                log.info("ending %d request(s) still in flight", len(pending))
                for ctx in list(self._contexts):
                    ctx.stop_generating()
                await asyncio.wait(pending, timeout=2.0)
        await self._runner.cleanup()
        self._runner = None

    # -- plain endpoints
    async def list_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": self.models.created(name), "owned_by": "dynamo"}
            for name in self.models.names()
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        instances = self.models.instances() if self.models.instances else []
        names = self.models.names()
        if not names:
            body = {"status": "unhealthy", "message": "No models available", "models": [], "instances": instances}
            return _json(body, status=503)
        return _json({"status": "healthy", "models": names, "instances": instances})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"status": "live", "message": "Service is live"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- generation
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "chat_completions", parse_chat_request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "completions", parse_completion_request)

    async def _admit(self, request: web.Request, endpoint: str, parse: Callable[[Any], Any]) -> web.StreamResponse:
        """The frontend-wide limit, checked before the body is read: past it, a 503 costs next to nothing."""
        if self._admitted >= self.max_inflight:
            self.metrics.rejected("", endpoint)  # the body is not read: the model is not known
            raise ServiceUnavailableError(
                f"Too many requests in progress (limit {self.max_inflight}); try again shortly", overload=True)
        self._admitted += 1
        try:
            return await self._generate(request, endpoint, parse)
        finally:
            self._admitted -= 1

    async def _generate(self, request: web.Request, endpoint: str, parse: Callable[[Any], Any]) -> web.StreamResponse:
        t_in = time.perf_counter()
        raw = await _read_json(request)
        req = parse(raw)
        model = self.models.get(req.model)
        streaming = bool(req.stream)
        ctx = Context(_request_id(request, req))
        first_token.begin(ctx, t_in)
        rm = self.metrics.request(req.model, endpoint, streaming)
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        self._contexts.add(ctx)
        ok = False
        try:
            if isinstance(req, ChatCompletionRequest):
                stream = model.chat(req, raw, ctx)
            else:
                stream = model.completions(req, raw, ctx)
            if streaming:
                resp, ok = await self._stream_sse(request, stream, ctx, rm)
                return resp
            else:
                stream = _metered(stream, ctx, rm)
                fold = fold_chat if isinstance(req, ChatCompletionRequest) else fold_completion
                try:
                    body = await fold(stream, ctx, req.model)
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
                resp = _json(body)
                first_token.report(ctx, "answer")
            ok = True
            return resp
        except ServiceUnavailableError as e:
            if e.overload:
                self.metrics.rejected(req.model, endpoint)
            raise
        except asyncio.CancelledError:
            ctx.kill()
            log.debug("request %s cancelled: client went away", ctx.id)
            raise
        finally:
            rm.done(ok)
            self._contexts.discard(ctx)
            if task is not None:
                self._inflight.discard(task)

    async def _stream_sse(
        self, request: web.Request, stream: AsyncIterator[Any], ctx: Context, rm: Any
    ) -> tuple[web.StreamResponse, bool]:
        """Stream ``stream`` as SSE; returns the response and whether the stream completed without error."""
        # the first item before committing to 200: start-up failures get a real status code
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        else:
            rm.tokens(ctx.completion_tokens, ctx.prompt_tokens)
        first_token.stamp(ctx.stamps, "first item")
        resp = _SseResponse(status=200, headers=_SSE_HEADERS)
        try:
            await resp.prepare(request)
        except (ConnectionResetError, ConnectionError):
            ctx.kill()
            await stream.aclose()  # type: ignore[attr-defined]
            log.debug("request %s: client went away before the response started", ctx.id)
            return resp, False
        # The rest runs as its own task: a token then wakes a short chain of frames (this pump and the
        # pipeline) instead of aiohttp's request handler, the middlewares and this handler as well,
        # about ten frame resumptions per token.  Cancelling the handler (the client left) cancels it.
        pump = asyncio.get_running_loop().create_task(_pump_sse(resp, request, stream, ctx, rm, first))
        return resp, await pump

async def _pump_sse(resp: web.StreamResponse, request: web.Request, stream: AsyncIterator[Any], ctx: Context,
                    rm: Any, first: Any) -> bool:
    """Write the stream's items as SSE events; whether it ended without error.

    Every item that is ready when we look leaves in one write: a paced stream still sends each token
    as it comes, and a stream that fell behind catches up with one send per batch.  Each
    ``__anext__`` call is started here, to see whether its item is ready without waiting for it, and
    finished with ``aio.finish`` when it must wait (``aio.next_now`` does the same through a helper
    object: two Python calls more per token, on the per-token path of every stream).
    """
    dumps = orjson.dumps
    tokens = rm.tokens
    sink = _ChunkSink(resp, request)
    parts: list[bytes] = []
    step: Any = None  # an ``__anext__`` call that had to wait and is not finished
    ok = gone = False
    try:
        if first is not None:
            parts.append(_sse(first, dumps))
            anext = stream.__anext__
            in_a_row = 0
            while True:
                call: Any = anext().__await__()  # an async generator's asend object itself
                try:
                    signal = call.send(None)
                except StopIteration as done:
                    item = done.value
                    in_a_row += 1
                except StopAsyncIteration:
                    break
                else:
                    # not ready: what was gathered leaves now, then wait for the item as the task would
                    in_a_row = 0
                    if parts:
                        step = call  # a failed write must end the call it interrupted
                        w = sink.write(parts)
                        if w is not None:
                            await w
                        if ctx.stamps is not None:
                            first_token.report(ctx)
                        step = None
                    item = await finish(call, signal)
                tokens(ctx.completion_tokens, ctx.prompt_tokens)
                data = _sse(item, dumps)
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
        status = e.status if isinstance(e, RequestError) else 500
        parts.append(b"data: " + error_body(str(e), status) + b"\n\n")
    except (ConnectionResetError, ConnectionError):
        ctx.kill()
        log.debug("request %s: client went away", ctx.id)
        gone = True
    except Exception as e:  # our bug: the headers are out, so end the stream cleanly rather than cut it
        log.exception("request %s: internal error mid-stream", ctx.id)
        parts.append(b"data: " + error_body(f"Internal server error: {type(e).__name__}: {e}", 500) + b"\n\n")
    finally:
        if step is not None:  # a write failed (or we were cancelled) while an item was awaited
            await abandon(step)
        await stream.aclose()  # type: ignore[attr-defined]
    if gone:
        return False
    parts.append(_DONE)
    try:
        await resp.write_eof(b"".join(parts))  # the last items, [DONE] and the end of the body: one send
        first_token.report(ctx)  # (a stream that was whole before its first write)
    except (ConnectionResetError, ConnectionError):  # the client left as its stream ended: not our error
        log.debug("request %s: client went away before the end of the stream", ctx.id)
        return False
    return ok


async def _write_parts(resp: web.StreamResponse, parts: list[bytes]) -> None:
    """One HTTP chunk with the SSE events gathered so far; empties ``parts``."""
    data = b"".join(parts) if len(parts) > 1 else parts[0]
    parts.clear()
    await resp.write(data)


def _sse(item: Any, dumps: Callable[[Any], bytes]) -> bytes:
    if type(item) is dict:
        return b"data: " + dumps(item) + b"\n\n"
    if type(item) is LazyJson:  # a remote worker's chunk: its own bytes when nothing changed it
        raw = item.raw
        return b"data: " + (raw if raw is not None else dumps(dict(item.items()))) + b"\n\n"
    if isinstance(item, Annotation):
        return b"event: " + item.name.encode() + b"\n: " + dumps(item.value) + b"\n\n"
    return b""


async def _metered(stream: AsyncIterator[Any], ctx: Context, rm: Any) -> AsyncIterator[Any]:
    try:
        async for item in stream:
            rm.tokens(ctx.completion_tokens, ctx.prompt_tokens)
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _read_json(request: web.Request) -> Any:
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"Request body too large (limit {request.app[BODY_LIMIT_KEY]} bytes)", status=413) from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        ctype = request.content_type
        if body and ctype not in ("application/json", "application/octet-stream", "") and "json" not in ctype:
            raise RequestError(
                f"Expected request with `Content-Type: application/json` (got {ctype})", status=415
            ) from None
        raise RequestError(f"Failed to parse the request body as JSON: {e}") from None


def _request_id(request: web.Request, req: ChatCompletionRequest | CompletionRequest) -> str | None:
    rid = request.headers.get("x-dynamo-request-id") or request.headers.get("x-request-id")
    if rid and 0 < len(rid) <= 128 and rid.replace("-", "").replace("_", "").isalnum():
        return rid
    return None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def _error_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return request_error_response(e)
    except web.HTTPException as e:
        if e.status == 404:
            return error_response(f"Not found: {request.method} {request.path}", 404)
        if e.status == 405:
            return error_response(f"Method {request.method} not allowed for {request.path}", 405)
        if e.status == 413:
            return error_response(f"Request body too large (limit {request.app[BODY_LIMIT_KEY]} bytes)", 413)
        return error_response(e.reason or "HTTP error", e.status)
    except EngineError as e:
        log.error("engine error: %s", e)
        return error_response(f"Failed to generate completions: {e}", 500)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # our bug: log it fully, answer cleanly
        log.exception("internal error handling %s %s", request.method, request.path)
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)


def _listen_socket(host: str, port: int) -> socket.socket:
    from dynamo.frontend.http.listen import take_adopted

    adopted = take_adopted()  # --http-workers: the parent bound it
    if adopted is not None:
        return adopted
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from dynamo.errors import UserError

        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock
