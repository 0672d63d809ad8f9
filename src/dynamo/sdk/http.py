"""``@api()`` methods as HTTP routes: ``POST /<name>`` on the service's port, on aiohttp.

aiohttp, not FastAPI (which the original used): it is already the project's HTTP server, and what a
graph's routes need is small.  The JSON body is bound to the method's parameters: a single parameter
annotated with a pydantic model gets the whole body parsed into it (a 422 naming the error otherwise),
else the body's keys are the parameters' names.  What the method gives back decides the response:

* an async generator: streamed as it yields (``str`` as text, ``bytes`` as is, anything else as one JSON
  line);
* an object with ``body_iterator`` (Starlette/FastAPI's ``StreamingResponse``, as the original's
  hello world returns): that iterator streamed with its ``media_type``, without importing Starlette;
* anything else: JSON.

The first item is awaited before the status is sent, so a failure at the start is a proper 500.
Several replicas of an ``@api`` service share the port (``SO_REUSEPORT``).
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from dynamo.runtime import tracing

from .annotations import is_model, request_annotation

log = logging.getLogger(__name__)

DEFAULT_PORT = 3000
DEFAULT_HOST = "127.0.0.1"


def _encode(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    dump = getattr(item, "model_dump_json", None)
    if callable(dump):
        return (dump() + "\n").encode()
    return (json.dumps(item) + "\n").encode()


def _bind(fn: Callable[..., Any], body: Any) -> dict[str, Any]:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    if len(params) == 1:
        ann = request_annotation(fn)
        if ann is not None and is_model(ann):
            return {params[0].name: ann.model_validate(body)}
    if not params:
        return {}
    if not isinstance(body, dict):
        if len(params) == 1:
            return {params[0].name: body}
        raise ValueError("the body must be a JSON object whose keys are the parameters' names")
    kwargs = {p.name: body[p.name] for p in params if p.name in body}
    missing = [p.name for p in params if p.name not in body and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    return kwargs


async def _stream(request: web.Request, items: AsyncIterator[Any], content_type: str) -> web.StreamResponse:
    it = items.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = None
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    await resp.prepare(request)
    if first is not None:
        await resp.write(_encode(first))
        async for item in it:
            await resp.write(_encode(item))
    await resp.write_eof()
    return resp


def route(instance: Any, fn: Callable[..., Any]) -> Callable[[web.Request], Any]:
    bound = fn.__get__(instance, type(instance))

    async def handle(request: web.Request) -> web.StreamResponse:
        if not tracing.ENABLED:
            return await answer(request)
        # the graph's server span (the client's traceparent its parent), current in this task: the calls
        # the endpoint makes to other services are its children (runtime/client.py)
        span = tracing.start_remote_child(f"{request.method} {request.path}", request.headers, attributes={
            "http.request.method": request.method, "url.path": request.path})
        token = tracing.attach(span)
        try:
            resp = await answer(request)
            if span is not None:
                span.set_attribute("http.response.status_code", resp.status)
                if resp.status >= 400:
                    tracing.fail(span, f"HTTP {resp.status}")
            return resp
        finally:
            if span is not None:
                span.end()
            tracing.detach(token)

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
            kwargs = _bind(fn, body)
        except Exception as e:  # malformed JSON, a pydantic ValidationError, a missing field
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=422)
        try:
            if inspect.isasyncgenfunction(fn):
                return await _stream(request, bound(**kwargs), "text/plain; charset=utf-8")
            result = bound(**kwargs)
            if inspect.isawaitable(result):
                result = await result
            body_iter = getattr(result, "body_iterator", None)
            if body_iter is not None:
                media = getattr(result, "media_type", None) or "text/plain; charset=utf-8"
                return await _stream(request, body_iter, media)
            dump = getattr(result, "model_dump", None)
            return web.json_response(dump(mode="json") if callable(dump) else result)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)

    return handle


async def start_api(instance: Any, routes: dict[str, Callable[..., Any]], host: str, port: int) -> web.AppRunner:
    app = web.Application()
    for name, fn in routes.items():
        app.router.add_post("/" + name, route(instance, fn))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=True).start()
    return runner
