"""The event plane over NATS core pub/sub (the first :class:`~dynamo.runtime.event_plane.EventPlane`):
at-most-once, no persistence, as the event plane promises."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NatsClient

from .event_plane import EventHandler, Subscription


class NatsEventPlane:
    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def publish(self, subject: str, payload: bytes) -> None:
        await self.nc.publish(subject, payload)

    async def subscribe(self, subject: str, handler: EventHandler) -> Subscription:
        async def on_message(msg: Any) -> None:
            await handler(msg.subject, msg.data)

        return await self.nc.subscribe(subject, cb=on_message)

    @property
    def reconnects(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0
