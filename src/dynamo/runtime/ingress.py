"""Worker side of an endpoint: take requests from NATS, run the handler, stream its items back.

Each request runs in its own task (requests are served concurrently). The NATS callback only decodes,
acks and spawns, so one slow handler never delays the next request's ack.

Handler contract: ``handler(request)`` or ``handler(request, context)`` (two positional parameters)
returns an async iterator (normally it *is* an async generator) of JSON-serialisable items. An exception
becomes an error item, and the worker keeps serving. ``kill`` from the client (or its socket closing)
cancels the handler's task, so the generator sees CancelledError/GeneratorExit and its work stops.
``stop`` does the same for one-parameter handlers; two-parameter handlers see ``context.is_stopped()``
and end the stream themselves.

Draining (the worker shuts down): new requests are refused (the client sends them elsewhere), the ones in
flight get up to the drain timeout to finish; a stream still running then is stopped with a ``drained``
item, which tells the client to resume the request on another worker rather than fail it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable

import orjson

from dynamo.aio import abandon, finish

from . import tracing
from .annotated import Annotated
from .codec import decode_frame
from .component_metrics import (
    ERROR_DESERIALIZATION,
    ERROR_GENERATE,
    ERROR_INVALID_MESSAGE,
    ERROR_RESPONSE_STREAM,
    EndpointMetrics,
)
from .context import Context
from .request_plane import CarriesHeaders
from .tcp import TRANSPORT_NAME as TCP_TRANSPORT
from .tcp import is_loopback, split_address
from .tcp_callhome import open_tcp_sink
from .transport import (
    ACK_BUSY,
    ACK_PROBE,
    ACK_REFUSED,
    CLIENT_KEY,
    CLIENT_OURS,
    FRAME_DRAINED,
    PROBE_KEY,
    encode_item,
    parse_request_control_full,
)
from .v1_wire import JSON, MSGPACK, V1WireError, decode_body, request_codec

log = logging.getLogger(__name__)

Handler = Callable[..., Any]
YIELD_EVERY = 64  # items written without the loop turning before the pump yields once
REFUSED = ACK_REFUSED


def handler_takes_context(handler: Handler) -> bool:
    """True when the handler accepts a second positional argument (the Context)."""
    try:
        params = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 2


async def _as_async_iterator(result: Any):
    """Accept an async iterator, an awaitable giving one, or an awaitable giving a single item."""
    if hasattr(result, "__anext__"):
        return result
    if hasattr(result, "__aiter__"):
        return result.__aiter__()
    if inspect.isawaitable(result):
        value = await result
        if hasattr(value, "__aiter__"):
            return value.__aiter__()

        async def single():
            yield value
        return single()
    raise TypeError(f"handler must return an async iterator, got {type(result).__name__}")


SinkOpener = Callable[[str, dict, Context], Awaitable[Any]]


class Ingress:
    """Serves one endpoint's requests and tracks them for graceful shutdown."""

    def __init__(self, handler: Handler, *, name: str = "", sink_openers: dict[str, SinkOpener] | None = None,
                 max_inflight: int | None = None, metrics: EndpointMetrics | None = None) -> None:
        self.handler = handler
        self.metrics = metrics  # dynamo_component_* series (None: the runtime has no status server)
        self.max_inflight = max_inflight  # refuse more than this many requests at once (None: no limit)
        self.name = name
        self.takes_context = handler_takes_context(handler)
        self.inflight: set[asyncio.Task] = set()
        self.accepting = True
        self.probes: set[asyncio.Task] = set()  # empty streams answering clients' probes (runtime/probe.py)
        self.drained: set[asyncio.Task] = set()  # stopped by a drain that timed out: told to resume elsewhere
        self._openers: dict[str, SinkOpener] = {TCP_TRANSPORT: open_tcp_sink}
        if sink_openers:
            self._openers.update(sink_openers)

    # called by NATS (micro endpoint handler): keep it short
    async def on_request(self, request: Any) -> None:
        if not request.data:  # a ping (a client probing an instance it thought frozen)
            await request.respond(b"" if self.accepting else REFUSED)
            return
        metrics = self.metrics
        try:
            header, body = decode_frame(request.data)
            request_id, transport, info, control = parse_request_control_full(header)
        except Exception as exc:
            log.warning("%s: undecodable request: %s", self.name, exc)
            if metrics is not None:
                metrics.received(len(request.data))
                metrics.error(ERROR_DESERIALIZATION)
            # the client is told why (a text ack: not taken); nothing will stream back either way
            await request.respond(f"Decode error: {exc}".encode())
            return
        if not self.accepting:
            await request.respond(REFUSED)  # the client treats it like "no responders"
            return
        if control.get(PROBE_KEY) is True:  # a client checking both paths to us before it sends us requests
            await request.respond(ACK_PROBE)  # "an empty stream follows"
            self._answer_probe(request_id, transport, info)
            return
        if metrics is not None:
            metrics.received(len(request.data))
        # a request without our client's mark comes from a Dynamo 1.x client: it knows no ``drained`` item, and
        # it does not queue a request a full worker refuses (1.6.1's frontend retries "overloaded" on another
        # worker, then fails it: measured in front of two llama.cpp workers at 64 streams, 17,629 errors in
        # 40 s), so its requests are taken and wait in the engine's own queue, as behind 1.x's own workers
        v1 = control.get(CLIENT_KEY) != CLIENT_OURS
        if self.max_inflight is not None and len(self.inflight) >= self.max_inflight and not v1:
            await request.respond(ACK_BUSY)  # our client tries another instance or queues the request
            return
        await request.respond(b"")  # ack at once; the response comes over the stream
        codec = request_codec(control)
        trace = None
        if tracing.ENABLED:  # the W3C context, in the message's headers (1.x's place) on either plane
            headers = request.headers if isinstance(request, CarriesHeaders) else None
            trace = headers if headers and "traceparent" in headers else None
        task = asyncio.get_running_loop().create_task(
            self._serve(request_id, transport, info, body, codec, v1, trace))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    def _answer_probe(self, request_id: str, transport: str, info: dict) -> None:
        """An empty stream back to the prober: it proves our response path reaches it (a request plane
        that reaches us through NATS says nothing about the direct path back)."""

        async def answer() -> None:
            opener = self._openers.get(transport)
            if opener is None:
                return
            try:
                sink = await opener(transport, info, Context(request_id))
            except Exception as exc:  # noqa: BLE001 - the prober does not hear from us: that is its answer
                log.debug("%s: probe %s: cannot open a response stream: %s", self.name, request_id, exc)
                return
            sink.send_prologue()
            sink.finish()

        task = asyncio.get_running_loop().create_task(answer(), name=f"probe-answer:{request_id}")
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)

    async def _serve(self, request_id: str, transport: str, info: dict, body: bytes, codec: str = JSON,
                     v1: bool = False, trace: Any = None) -> None:
        span = token = None
        if trace is not None and "traceparent" in trace:
            # the worker's server span, a child of the client's request-plane span; current in this task, so
            # the handler's logs carry its ids and the requests it sends on are its children
            span = tracing.start_remote_child(f"dynamo.worker {self.name}", trace, attributes={
                "rpc.system": "dynamo", "rpc.service": self.name, "dynamo.request_id": request_id})
            token = tracing.attach(span)
        metrics = self.metrics
        try:
            if metrics is None:
                await self._serve_one(request_id, transport, info, body, None, codec, v1, span)
                return
            start = metrics.started()
            sent = [0]  # response bytes, added up by the pump and reported once (nothing per token)
            try:
                await self._serve_one(request_id, transport, info, body, sent, codec, v1, span)
            finally:
                metrics.finished(start, sent[0])
        finally:
            if span is not None:
                span.end()
                tracing.detach(token)

    def _error(self, error_type: str) -> None:
        if self.metrics is not None:
            self.metrics.error(error_type)

    async def _serve_one(self, request_id: str, transport: str, info: dict, body: bytes,
                         sent: list[int] | None, codec: str = JSON, v1: bool = False,
                         span: tracing.Span | None = None) -> None:
        context = Context(request_id)
        context.trace = span
        opener = self._openers.get(transport)
        if opener is None:
            log.error("%s: request %s wants unknown transport %r", self.name, request_id, transport)
            self._error(ERROR_INVALID_MESSAGE)
            return
        try:
            sink = await opener(transport, info, context)
        except Exception as exc:
            log.warning("%s: cannot open response stream for %s%s", self.name, request_id, _why_no_stream(info, exc))
            self._error(ERROR_RESPONSE_STREAM)
            return
        if codec == MSGPACK:
            use_msgpack = getattr(sink, "use_msgpack", None)
            if use_msgpack is None:  # (a 1.x client only ever asks for per-stream TCP call-home)
                sink.send_prologue(f"this worker cannot send msgpack over the {transport!r} response transport")
                sink.finish()
                return
            use_msgpack()
        encode = getattr(sink, "encode_item", encode_item)
        task = asyncio.current_task()
        takes_context = self.takes_context

        uncounted = [self.metrics]  # counted as cancelled once, at its first stop or kill

        def on_signal(kind: str) -> None:
            counter = uncounted.pop() if uncounted else None
            if counter is not None:
                counter.cancelled()
            if kind == "kill" or not takes_context:
                if task is not None and not task.done():
                    task.cancel()

        context.add_callback(on_signal)
        agen = None
        try:
            try:
                request = (orjson.loads(body) if codec == JSON else decode_body(body, codec)) if body else None
            except (ValueError, V1WireError) as exc:  # orjson's and msgspec's decode errors are ValueErrors
                log.warning("%s: request %s has an undecodable body: %s", self.name, request_id, exc)
                self._error(ERROR_DESERIALIZATION)
                sink.send_prologue(f"invalid request body: {exc}")
                sink.finish()
                return
            try:
                result = self.handler(request, context) if takes_context else self.handler(request)
                agen = await _as_async_iterator(result)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s: handler failed to start for %s: %s", self.name, request_id, exc)
                self._error(ERROR_GENERATE)
                tracing.fail(span, _message(exc))
                sink.send_prologue(_message(exc))
                sink.finish()
                return
            sink.send_prologue()
            await self._pump(agen, sink, sent)
            sink.finish()
        except asyncio.CancelledError:
            # kill/stop from the client, or shutdown past its grace period
            if task in self.drained and not context.is_stopped():
                if not v1:  # (a 1.x client knows no "drained": the stream's end without completion tells it)
                    sink.write(FRAME_DRAINED)  # the client resumes the request on another worker
                sink.abort()
            elif context.is_killed() or not context.is_stopped():
                sink.abort()
            else:
                sink.finish()
        except Exception as exc:  # the handler raised mid-stream: report it, keep serving
            log.info("%s: handler error for %s: %s", self.name, request_id, exc)
            self._error(ERROR_GENERATE)
            tracing.fail(span, _message(exc))
            frame = encode(Annotated.from_error(_message(exc)))
            if sent is not None:
                sent[0] += len(frame)
            sink.write(frame)
            sink.finish()
        finally:
            context.remove_callback(on_signal)
            if agen is not None and hasattr(agen, "aclose"):
                try:
                    await agen.aclose()  # GeneratorExit inside the handler if it was parked at a yield
                except BaseException:  # noqa: BLE001 - whatever the handler does on close, we are done
                    pass

    @staticmethod
    async def _pump(agen: Any, sink: Any, sent: list[int] | None = None) -> None:
        """Frames of the items the handler has ready leave together, the moment it has to wait.

        The bytes written are added to ``sent[0]`` when it ends (a ``len`` per write, and a write carries
        every item the handler had ready: no per-token bookkeeping beyond that)."""
        write = sink.write
        encode = getattr(sink, "encode_item", encode_item)  # a multiplexed stream's is more compact
        batch: list[bytes] = []
        in_a_row = 0  # items taken without the handler waiting
        pending: Any = None  # a started ``__anext__`` call while we drain
        nbytes = 0
        anext = agen.__anext__
        try:
            while True:
                # each call started here, to see whether the item is ready without waiting for it
                # (dynamo.aio.next_now's idea, inlined on the per-token path)
                call: Any = anext().__await__()  # an async generator's asend object itself
                try:
                    signal = call.send(None)
                except StopIteration as done:
                    item = done.value
                except StopAsyncIteration:
                    break
                else:
                    if batch:
                        data = b"".join(batch) if len(batch) > 1 else batch[0]
                        nbytes += len(data)
                        write(data)
                        batch.clear()
                    if sink.must_drain:
                        pending = call
                        await sink.drain()
                        pending = None
                    in_a_row = 0
                    try:
                        item = await finish(call, signal)
                    except StopAsyncIteration:
                        break
                try:
                    batch.append(encode(item))
                except TypeError as exc:
                    raise ValueError(f"invalid response object from handler: {exc}") from None
                in_a_row += 1
                if in_a_row >= YIELD_EVERY:
                    # A handler that never awaits would hold the loop for its whole stream: send what
                    # it has and let other requests run now and then (one extra loop turn per 64 items).
                    data = b"".join(batch)
                    nbytes += len(data)
                    write(data)
                    batch.clear()
                    in_a_row = 0
                    if sink.must_drain:
                        await sink.drain()
                    await asyncio.sleep(0)
        finally:
            if pending is not None:  # cancelled while draining, the handler's next item half-taken
                await abandon(pending)
            if batch:  # what the handler gave before it ended or failed goes out before the rest
                data = b"".join(batch) if len(batch) > 1 else batch[0]
                nbytes += len(data)
                write(data)
            if sent is not None:
                sent[0] += nbytes

    async def drain(self, timeout: float | None) -> None:
        """Stop accepting, wait up to ``timeout`` for in-flight requests, then stop the rest, each with a
        ``drained`` item so that its client resumes it on another worker."""
        self.accepting = False
        if self.inflight and (timeout is None or timeout > 0):
            await asyncio.wait(set(self.inflight), timeout=timeout)
        rest = [t for t in self.inflight if not t.done()]
        if rest:
            log.info("%s: %d request(s) still running after the drain timeout; handing them to other workers",
                     self.name, len(rest))
        for t in rest:
            self.drained.add(t)
            t.cancel()
        if rest:
            await asyncio.gather(*rest, return_exceptions=True)


def _message(exc: BaseException) -> str:
    text = str(exc)
    return text if text else type(exc).__name__


def _why_no_stream(info: dict, exc: Exception) -> str:
    """The tail of the warning for a response stream that could not be opened: where it dialed, why it
    failed, and, for a loopback address, the setting the caller lacks. A caller on another machine whose
    host name resolves to loopback advertises 127.0.0.1, which here is this machine: its requests are
    acknowledged and then wait for a stream that never comes (the caller sees the call-home bound pass)."""
    address = info.get("address")
    if not isinstance(address, str):
        return f": {exc}"
    try:
        host, _ = split_address(address)
    except ValueError:
        return f" to {address}: {exc}"
    if not is_loopback(host):
        return f" to {address}: {exc}"
    return (f" to {address}: {exc} (the caller advertised a loopback address: a caller on another machine "
            f"must set DYN_TCP_RPC_HOST to its address that this machine reaches)")
