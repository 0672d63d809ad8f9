"""The event plane: fire-and-forget events between processes (KV events, load, a router's bookings),
whatever carries them (:mod:`.event_channels`: ZMQ or NATS, Dynamo 1.x's envelopes and records).

A stream belongs to a scope (an endpoint) and a topic; each publisher of it is announced by its
``v1/event_channels`` record and a subscriber follows every publisher of its scope and topic.  Publishing
never waits for subscribers and an event may be lost (a subscriber not yet connected, a connection down):
consumers that need every event keep a way to ask for a snapshot, and :attr:`EventPlane.reconnects` tells
them when to.  This module is the seam the rest of the code holds (no pyzmq behind it).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .v1_event_wire import EndpointScope, Envelope

EnvelopeHandler = Callable[[Envelope], None]


class EventPublisher(Protocol):
    scope: EndpointScope
    topic: str
    publisher_id: int
    # ``zmq`` or ``nats``: how its events travel (1.x frames some topics by it: active-sequence events are
    # batches on ZMQ, bare on NATS)
    transport: str

    def publish(self, payload: bytes) -> Any:
        """Send one event; returns what to await for it to leave, or None."""


class EventSubscription(Protocol):
    async def unsubscribe(self) -> None: ...


class EventPlane(Protocol):
    async def publisher(self, scope: EndpointScope, topic: str) -> EventPublisher:
        """A new publisher of ``topic`` in ``scope``, announced under this process's lease."""

    async def register_source(self, pub: Any, metadata: dict[str, Any]) -> None:
        """Announce how a consumer recovers ``pub``'s stream (its ``v1/event_sources`` record)."""

    async def subscribe(self, scope: EndpointScope, topic: str, handler: EnvelopeHandler) -> EventSubscription:
        """Call ``handler(envelope)`` on the event loop for each event of every publisher of ``topic`` in
        ``scope``, now and as they come and go."""

    @property
    def reconnects(self) -> int:
        """Connections (re)made to publishers: events published before may have been missed."""

    async def close(self) -> None: ...
