"""runtime/ack.py: a request's wait ends at its ack or at its response stream's first frame."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import nats.errors
import pytest

from dynamo.runtime.ack import RequestSender
from dynamo.runtime.transport import StreamState


class FakeNats:
    """Records publishes; the test plays the worker and nats-server."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []
        self.headers: list[dict | None] = []
        self.cb = None

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb) -> None:
        assert subject == "_INBOX.test.*"
        self.cb = cb

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: dict | None = None) -> None:
        self.published.append((subject, payload, reply))
        self.headers.append(headers)

    async def reply(self, data: bytes = b"", headers: dict | None = None) -> None:
        _, _, reply = self.published[-1]
        await self.cb(SimpleNamespace(subject=reply, data=data, headers=headers))


async def test_the_ack_ends_the_wait():
    nc = FakeNats()
    sender = RequestSender(nc)
    state = StreamState("r", 1)
    task = asyncio.create_task(sender.send("subj", b"req", 5, state))
    await asyncio.sleep(0)
    assert nc.published[0][:2] == ("subj", b"req")
    assert nc.headers[0] == {"request-id": "r"}  # in the message's headers, as 1.6.1 sends it
    await nc.reply(b'{"error":"busy"}')
    assert await asyncio.wait_for(task, 1) == b'{"error":"busy"}'
    assert sender._waiting == {}


async def test_the_streams_first_frame_ends_the_wait_before_the_ack():
    nc = FakeNats()
    sender = RequestSender(nc)
    state = StreamState("r", 1)
    task = asyncio.create_task(sender.send("subj", b"req", 5, state))
    await asyncio.sleep(0)
    state.items.append({"data": 1})  # what a transport does with the first item
    state.wake()
    assert await asyncio.wait_for(task, 1) == b""
    await nc.reply(b"")  # the late ack is dropped
    assert sender._waiting == {} and state._waiter is None


async def test_no_responders_and_timeout():
    nc = FakeNats()
    sender = RequestSender(nc)
    task = asyncio.create_task(sender.send("subj", b"req", 5, StreamState("r", 1)))
    await asyncio.sleep(0)
    await nc.reply(b"", {"Status": "503"})
    with pytest.raises(nats.errors.NoRespondersError):
        await asyncio.wait_for(task, 1)
    with pytest.raises(TimeoutError):
        await sender.send("subj", b"req", 0.05, StreamState("r2", 1))
    assert sender._waiting == {}
