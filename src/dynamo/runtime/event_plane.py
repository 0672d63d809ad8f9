"""The event plane: fire-and-forget events between processes (KV cache events, load metrics, a
router's hit rates), whatever carries them.

Publishing never waits for subscribers and an event may be lost (a subscriber not yet subscribed, a
connection down): consumers that need every event keep a way to ask for a snapshot, and
:attr:`EventPlane.reconnects` tells them when to. NATS (:mod:`.nats_event_plane`) is the first
implementation; a ZMQ pub/sub plane is meant to fit the same interface, which is why subjects are plain
strings (no wildcards) and payloads bytes.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol, runtime_checkable

EventHandler = Callable[[str, bytes], Awaitable[None]]  # (subject, payload)


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


@runtime_checkable
class EventPlane(Protocol):
    async def publish(self, subject: str, payload: bytes) -> None:
        """Send one event to whoever subscribes to ``subject`` now."""

    async def subscribe(self, subject: str, handler: EventHandler) -> Subscription:
        """Call ``handler(subject, payload)`` for each event on ``subject`` from now on, one at a time."""

    @property
    def reconnects(self) -> int:
        """How many times the connection was lost and came back: events published meanwhile may be lost."""
