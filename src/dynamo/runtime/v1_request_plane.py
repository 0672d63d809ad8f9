"""Dynamo 1.x's TCP request plane, both ends of a connection: a 1.x client's connection to our worker,
and our client's connection to a 1.x worker. :mod:`.tcp_request_plane` hands a connection here when its
first bytes are 1.x's (worker side), and sends here when an instance's address is a 1.x one (client side);
the bytes themselves are :mod:`.v1_wire`'s.

Why a connection of its own kind rather than a mode of ours: 1.x's acks name no request, they come in
request order, one per request, on the connection the request came on; ours carry the request's
number. So a 1.x connection keeps its requests' acks in a queue: an ack that is ready waits for every
earlier one (a handler that acks late holds the later ones back, as in 1.6.1's own worker, which acks
before it runs anything), and a client matches each ack it reads to its oldest waiting request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable, cast

from dynamo.aio import finish

from .names import component_service_name, lease_hex
from .request_plane import NoResponders, RequestPlaneError
from .tcp import tune_socket
from .transport import ACK_BUSY, ACK_REFUSED
from .v1_wire import (
    ACK_OVERLOADED,
    ACK_UNAVAILABLE,
    MAX_REQUEST,
    AckDecoder,
    RequestDecoder,
    V1WireError,
    encode_ack,
    encode_request_message,
    parse_v1_path,
)

log = logging.getLogger(__name__)

# our acks (runtime/transport.py) as 1.x words them
_ACK_TEXT = {ACK_BUSY: ACK_OVERLOADED, ACK_REFUSED: ACK_UNAVAILABLE}


def our_endpoint_name(path: str) -> str:
    """The name our plane serves a 1.x path's endpoint under: ``<service>.<endpoint>-<instance hex>``."""
    instance_id, namespace, component, endpoint = parse_v1_path(path)
    return f"{component_service_name(namespace, component)}.{endpoint}-{lease_hex(instance_id)}"


async def _rest(call: Any, signal: Any) -> Any:
    return await finish(call, signal)


# ---------------------------------------------------------------------------------- worker side


class V1IncomingRequest:
    """One request from a 1.x client as the ingress sees it (the IncomingRequest of the other planes).
    ``v1`` tells the ingress that its peer is a 1.x process whatever its control JSON says."""

    __slots__ = ("data", "headers", "_conn", "_slot")
    v1 = True

    def __init__(self, conn: "V1ServerConnection", slot: list, data: bytes, headers: dict[str, str]) -> None:
        self.data = data
        self.headers = headers  # request-id, x-endpoint-path, a W3C traceparent when the client traces
        self._conn = conn
        self._slot = slot

    async def respond(self, data: bytes = b"") -> None:
        text = _ACK_TEXT.get(data, data.decode("utf-8", "replace")) if data else None
        self._conn.ack(self._slot, text)


class V1ServerConnection(asyncio.Protocol):
    """A 1.x client's connection to this worker's request-plane port: requests in, acks out in order.

    ``handlers`` is the plane's table (our endpoint names -> handler); ``plane`` the TCP plane, whose
    ``pending`` bounds the bytes of unfinished requests over all connections (``max_pending``)."""

    def __init__(self, plane: Any, transport: asyncio.Transport, max_pending: int) -> None:
        self.plane = plane
        self.transport: asyncio.Transport | None = transport
        self.decoder = RequestDecoder(MAX_REQUEST)
        self.max_pending = max_pending
        self.held = 0
        self.acks: deque[list] = deque()  # [ack bytes or None while the request's handler decides]
        self.tasks: set[asyncio.Future] = set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.plane.server_conns.discard(self)
        self.plane.pending -= self.held
        self.held = 0

    def _drop(self, why: str) -> None:
        if self.transport is not None:
            peer = self.transport.get_extra_info("peername")
            log.warning("request plane: dropping a Dynamo 1.x connection from %s: %s", peer, why)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            requests = self.decoder.feed(data)
        except V1WireError as exc:
            self._drop(str(exc))
            return
        held = self.decoder.buffered
        if held != self.held:
            plane = self.plane
            plane.pending += held - self.held
            self.held = held
            if plane.pending > self.max_pending:
                self._drop(f"the requests not yet complete on all connections would exceed {self.max_pending} "
                           f"bytes (this one holds {held})")
                return
        handlers = self.plane.handlers
        for path, headers, payload in requests:
            slot: list = [None]
            self.acks.append(slot)
            try:
                name = our_endpoint_name(path)
            except V1WireError as exc:
                self.ack(slot, f"Invalid endpoint path: {exc}")
                continue
            handler = handlers.get(name)
            if handler is None:  # stopped, or another process on this port: the client tries elsewhere
                self.ack(slot, f"Unknown endpoint: {path}")
                continue
            self._run(handler, V1IncomingRequest(self, slot, payload, headers), path)

    def _run(self, handler: Callable[[Any], Any], request: V1IncomingRequest, path: str) -> None:
        # as our plane does: the ingress normally acks and returns without waiting, so no task per request
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
        out = []
        while acks and acks[0][0] is not None:
            out.append(acks.popleft()[0])
        transport = self.transport
        if out and transport is not None and not transport.is_closing():
            transport.write(b"".join(out))


# ---------------------------------------------------------------------------------- client side


class V1ClientConnection(asyncio.Protocol):
    """This process's connection to one 1.x worker process: requests out, acks back in request order."""

    def __init__(self, hostport: str) -> None:
        self.hostport = hostport
        self.transport: asyncio.Transport | None = None
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
            log.warning("request plane: Dynamo 1.x worker %s sent garbage: %s", self.hostport, exc)
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
        transport.write(message)


def ack_result(ack: bytes, address: str) -> bytes:
    """A 1.x worker's ack as our plane's: empty (taken), ours for busy, or :class:`NoResponders`."""
    if not ack:
        return b""
    text = ack.decode("utf-8", "replace")
    if text.startswith("Server overloaded"):
        return ACK_BUSY
    raise NoResponders(f"{address}: {text}")
