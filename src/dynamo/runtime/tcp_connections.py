"""The TCP request plane's connections, both ends: a client's connection to a worker process (requests
out, acks back) and the worker's end of it. The bytes are Dynamo 1.x's (:mod:`.v1_wire`), the fleet's one
request wire: our clients and 1.6.1's send the same messages, our workers and 1.6.1's answer the same acks.

Why acks in a queue: 1.x's acks name no request, they come in request order, one per request, on the
connection the request came on. So a worker's connection keeps its requests' acks in order (an ack that
is ready waits for every earlier one: a handler that acks late holds the later ones back, as in 1.6.1's
own worker, which acks before it runs anything), and a client matches each ack it reads to its oldest
waiting request.

What the acks say (1.6.1's words, so that either kind of client reads either kind of worker):
empty: taken; ``Server overloaded: ...``: busy (the client tries another instance); ``Server unavailable:
...`` (draining, or ``unknown endpoint <path>``: nothing served under that path here, a stopped endpoint
or another process on a reused port) and any other text: the request did not reach a worker, as NATS's
"no responders". A request with an empty payload is a ping: our worker acks it as a request's ack
(taken, or refused while draining) and runs nothing; 1.6.1's acks it (taken) and drops it (observed).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable, cast

from dynamo.aio import finish

from .fleet_auth import is_fleet_hello, peer_name, refusals
from .request_plane import NoResponders, RequestPlaneError
from .tcp import tune_socket
from .transport import ACK_BUSY, ACK_PROBE, ACK_REFUSED
from .v1_wire import (
    ACK_OVERLOADED,
    ACK_UNAVAILABLE,
    AckDecoder,
    RequestDecoder,
    V1WireError,
    encode_ack,
    encode_request_message,
)

log = logging.getLogger(__name__)

# the ingress's acks (runtime/transport.py) as 1.x words them
_ACK_TEXT = {ACK_BUSY: ACK_OVERLOADED, ACK_REFUSED: ACK_UNAVAILABLE}
UNKNOWN_ENDPOINT = "Server unavailable: unknown endpoint "  # 1.6.1's refusal, followed by the path


async def _rest(call: Any, signal: Any) -> Any:
    return await finish(call, signal)


class CoalescingWriter:
    """What a connection writes during one loop turn leaves in one ``send`` at the end of the turn: a
    burst of requests (or of their acks) costs one system call, not one each, as nats-py's flusher does
    for the NATS plane."""

    __slots__ = ("transport", "_out", "_loop")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def write(self, data: bytes) -> None:
        if not self._out:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))


# ---------------------------------------------------------------------------------- worker side


class IncomingRequest:
    """One request as the ingress sees it (the IncomingRequest of the NATS plane), with the message's
    headers (``request-id``, ``x-endpoint-path``, a W3C ``traceparent`` when the client traces)."""

    __slots__ = ("data", "headers", "_conn", "_slot")

    def __init__(self, conn: "ServerConnection", slot: list, data: bytes, headers: dict[str, str]) -> None:
        self.data = data
        self.headers = headers
        self._conn = conn
        self._slot = slot

    async def respond(self, data: bytes = b"") -> None:
        text = _ACK_TEXT.get(data, data.decode("utf-8", "replace")) if data else None
        self._conn.ack(self._slot, text)


class ServerConnection(CoalescingWriter, asyncio.Protocol):
    """A client process's connection to this worker's request-plane port: requests in, acks out in order.

    ``plane`` is the TCP plane: ``handlers`` (endpoint path -> handler), ``server_conns`` (its open
    connections) and ``pending``, the bytes of unfinished requests over all connections, held to
    ``max_pending``."""

    def __init__(self, plane: Any, max_request: int, max_pending: int) -> None:
        super().__init__()
        self.plane = plane
        self.decoder = RequestDecoder(max_request)
        self.max_pending = max_pending
        self.held = 0
        self.acks: deque[list] = deque()  # [ack bytes or None while the request's handler decides]
        self.tasks: set[asyncio.Future] = set()  # handlers running (kept referenced until done)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune_socket(transport)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        self.plane.server_conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.plane.server_conns.discard(self)
        self.plane.pending -= self.held
        self.held = 0

    def _drop(self, reason: str, what: str) -> None:
        """Close this connection, naming the peer and what it did, in at most a line a minute per host."""
        if self.transport is not None:
            peer = peer_name(self.transport)
            refusals((peer.rpartition(":")[0], reason), f"request plane: dropping a connection from {peer}: {what}")
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            requests = self.decoder.feed(data)
        except V1WireError as exc:
            if is_fleet_hello(data) and self.transport is not None:
                peer = peer_name(self.transport)  # a fleet secret's hello, and this process has none
                refusals((peer.rpartition(":")[0], "no secret"), f"request plane: refused a connection from {peer}: "
                         "it authenticates with a fleet secret and this process has none (set DYN_FLEET_SECRET)")
                self.transport.close()
            else:
                self._drop("garbage", f"it sent garbage: {exc}")
            return
        held = self.decoder.buffered
        if held != self.held:
            plane = self.plane
            plane.pending += held - self.held
            self.held = held
            if plane.pending > self.max_pending:
                self._drop("pending", f"the requests not yet complete on all connections would exceed "
                           f"{self.max_pending} bytes (this one holds {held})")
                return
        handlers = self.plane.handlers
        for path, headers, payload in requests:
            slot: list = [None]
            self.acks.append(slot)
            handler = handlers.get(path)
            if handler is None:  # stopped, or another process on this port: the client tries elsewhere
                self.ack(slot, UNKNOWN_ENDPOINT + path)
                continue
            self._run(handler, IncomingRequest(self, slot, payload, headers), path)

    def _run(self, handler: Callable[[Any], Any], request: IncomingRequest, path: str) -> None:
        # the ingress normally acks and returns without waiting: run it here, and make a task of it only
        # if it has to wait (a task per request costs more than the request's ack)
        call: Any = handler(request)
        try:
            signal = call.send(None)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a failing handler must not drop the connection
            log.warning("request plane: handler for %s failed: %s", path, exc)
            self.ack(request._slot, f"Server error: {exc}")
            return
        task: asyncio.Future = asyncio.ensure_future(_rest(call, signal))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def ack(self, slot: list, error: str | None) -> None:
        """Record one request's ack; send every ack now ready at the head of the queue, in order."""
        if slot[0] is not None:
            return  # answered already
        slot[0] = encode_ack(error)
        acks = self.acks
        while acks and acks[0][0] is not None:
            self.write(acks.popleft()[0])


# ---------------------------------------------------------------------------------- client side


class ClientConnection(CoalescingWriter, asyncio.Protocol):
    """This process's connection to one worker process: requests out, acks back in request order."""

    def __init__(self, hostport: str) -> None:
        super().__init__()
        self.hostport = hostport
        self.decoder = AckDecoder()
        self.waiting: deque[asyncio.Future] = deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune_socket(transport)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        waiting, self.waiting = self.waiting, deque()
        for fut in waiting:  # no ack will come: the worker process is gone
            if not fut.done():
                fut.set_exception(NoResponders(self.hostport))

    def data_received(self, data: bytes) -> None:
        try:
            acks = self.decoder.feed(data)
        except V1WireError as exc:
            if is_fleet_hello(data):
                refusals((self.hostport, "no secret"), f"request plane: {self.hostport} requires a fleet secret "
                         "and this process has none (set DYN_FLEET_SECRET)")
            else:
                log.warning("request plane: %s sent garbage: %s", self.hostport, exc)
            if self.transport is not None:
                self.transport.close()
            return
        waiting = self.waiting
        for ack in acks:
            if not waiting:
                log.warning("request plane: %s acknowledged a request this process never sent", self.hostport)
                continue
            fut = waiting.popleft()
            if not fut.done():  # (done: the stream's first frame came first, or the caller gave up)
                fut.set_result(ack)

    def send(self, path: str, headers: dict[str, str], payload: bytes, fut: asyncio.Future) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise NoResponders(self.hostport)  # lost between the dial and now
        try:
            message = encode_request_message(path, headers, payload)
        except V1WireError as exc:
            raise RequestPlaneError(f"cannot send to {self.hostport}: {exc}") from None
        self.waiting.append(fut)  # each ack answers the oldest request waiting on this connection
        self.write(message)


def ack_result(ack: bytes, address: str) -> bytes:
    """A worker's ack as the client reads it: empty (taken), :data:`ACK_BUSY`, :data:`ACK_PROBE`, or
    :class:`NoResponders`."""
    if not ack or ack == ACK_PROBE:
        return ack
    text = ack.decode("utf-8", "replace")
    if text.startswith("Server overloaded"):
        return ACK_BUSY
    raise NoResponders(f"{address}: {text}")
