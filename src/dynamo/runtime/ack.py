"""Sending a request over NATS and waiting for its acknowledgement, or for the first frame of its response
stream, whichever comes first.

Why not ``nats.request``: its reply crosses nats-server and then four or five turns of this process's
event loop (the reader task, the inbox subscription's task, the future's callbacks, the caller) before
the caller runs, while the worker's first frame, sent right after the ack, comes straight over the
call-home connection in one. Under load every turn waits behind every other stream's tokens, so a new
request's first token waited for its ack (docs/performance.md). A response stream that has started is
as good an acknowledgement as the ack itself (the worker only starts streams it accepted), so either
one ends the wait; the other is then ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors

from .transport import StreamState

_STATUS = "Status"
_NO_RESPONDERS = "503"


class RequestSender:
    """One per runtime: a wildcard inbox subscription for the acks, a future per request in flight."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future] = {}
        self._next = 0
        self._lock = asyncio.Lock()

    async def _subscribe(self) -> None:
        async with self._lock:
            if self._prefix:
                return
            inbox = self.nc.new_inbox()
            await self.nc.subscribe(inbox + ".*", cb=self._on_reply)
            self._prefix = inbox + "."

    async def _on_reply(self, msg: Any) -> None:
        fut = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def send(self, subject: str, payload: bytes, timeout: float, state: StreamState) -> bytes:
        """The ack's payload (empty: accepted), or empty when the stream's first frame came first.

        Raises ``nats.errors.NoRespondersError`` (nobody on the subject) or ``TimeoutError`` (neither
        within ``timeout``), and whatever ``publish`` raises when NATS is away.
        """
        if not self._prefix:
            await self._subscribe()
        self._next += 1
        token = str(self._next)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[token] = fut
        state.set_waiter(fut)  # StreamState.wake() ends the wait when the stream's first data arrives
        try:
            # 1.6.1's headers on this plane: the request's id, and the W3C trace context when tracing
            headers = {"request-id": state.request_id, **state.trace} if state.trace else {"request-id": state.request_id}
            await self.nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
            async with asyncio.timeout(timeout):
                msg = await fut
        finally:
            self._waiting.pop(token, None)
            state.clear_waiter(fut)
        if msg is None:
            return b""  # the stream started: accepted
        headers = msg.headers
        if headers and headers.get(_STATUS) == _NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        return bytes(msg.data)
