"""The request plane: how a request reaches one instance and how its acknowledgement comes back,
whatever carries it.

A client sends a request (bytes: a two-part frame naming the response stream) to an instance's address
and waits for the instance's ack: empty when it took the request, else a short refusal (busy, shutting
down; :mod:`.transport`). The response stream itself travels separately (TCP call-home), and its first
frame ends the wait as well as the ack does. A worker serves an endpoint at an address and answers each
request it gets with an ack. NATS (:mod:`.nats_request_plane`) is the first implementation; a direct TCP
plane is meant to fit the same interface, which is why addresses are opaque strings, payloads bytes,
and failures the plane's own exceptions below rather than a client library's.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

from .transport import StreamState


class NoResponders(Exception):
    """Nobody serves the address (the instance is gone): the request did not reach a worker."""


class RequestPlaneError(Exception):
    """The plane itself is unavailable (disconnected, closed): the request did not leave."""


class IncomingRequest(Protocol):
    """One request as a worker's handler gets it."""

    @property
    def data(self) -> bytes: ...

    async def respond(self, data: bytes = b"") -> None:
        """The ack (empty: taken)."""


@runtime_checkable
class CarriesHeaders(Protocol):
    """A request that came with headers (a TCP request message's, a NATS message's; None: none): the W3C
    trace context (``traceparent``, ``tracestate``) is among them when the client traces."""

    headers: dict[str, str] | None


RequestHandler = Callable[[Any], Awaitable[None]]  # called with an IncomingRequest


class ServedEndpoint(Protocol):
    """An endpoint a worker serves; ``stop()`` ends serving it (requests then find no responder)."""

    address: str

    async def stop(self) -> None: ...


@runtime_checkable
class RequestPlane(Protocol):
    # ---- client side
    @property
    def connected(self) -> bool:
        """False while the plane's connection is down (it may be reconnecting)."""

    async def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a reconnecting plane; True once connected, False if not (or closed)."""

    async def send(self, address: str, payload: bytes, timeout: float, state: StreamState | None = None) -> bytes:
        """Send ``payload`` to ``address``; the ack's payload (empty: taken), or empty when ``state``'s
        response stream delivered its first frame first.

        Raises :class:`NoResponders`, ``TimeoutError`` (no ack within ``timeout``: the instance may be
        frozen) or :class:`RequestPlaneError` (nothing was sent)."""

    # ---- worker side
    async def add_service(self, name: str, *, description: str = "",
                          stats_handler: Callable[[Any], Any] | None = None) -> None:
        """Announce a service (a component) whose endpoints this process serves; a second call for the same
        name raises :class:`~dynamo.runtime.errors.ServiceAlreadyExistsError`."""

    def set_stats_handler(self, name: str, stats_handler: Callable[[Any], Any]) -> None:
        """User data for the service's statistics (load metrics); the service must exist."""

    async def serve(self, service: str, endpoint: str, handler: RequestHandler, path: str = "") -> ServedEndpoint:
        """Serve ``endpoint`` of ``service`` (announced first if need be) with ``handler``; requests can
        arrive once this returns. ``path`` is the endpoint's name on a TCP port,
        ``{instance_id:x}/{namespace}/{component}/{endpoint}`` (NATS names it by ``service`` and ``endpoint``)."""

    async def close(self) -> None:
        """Stop every endpoint and service and release the connection."""
