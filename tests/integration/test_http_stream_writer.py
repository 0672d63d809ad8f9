"""The SSE writer (``frontend/http/sse.py``'s pump): what a client sees of how it drives a stream.

The writer drives each ``__anext__`` call itself (to send every ready item in one write without ever
waiting for one), so it has to relay whatever the engine awaits exactly as an asyncio task would:
futures that fail, bare yields, ``asyncio.timeout`` (which cancels the task and takes the
cancellation back), a client that leaves. Stand-in engines on a real socket; raw HTTP where the
chunk boundaries are the point.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, AsyncIterator

import httpx
import pytest

from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.service import HttpService
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.chunks import ChatChunks
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from harness.wait import until

BIG_ITEMS = 4000  # about 1 MB of events: many direct writes and drain checks (every 64 KiB) in one stream
HUGE_ITEMS = 20000  # about 8 MB: far more than the socket buffers between the writer and a stalled client


class StandIn:
    tokenizer = None

    def __init__(self, name: str, engine: Any):
        self.name = name
        self.card = ModelCard.placeholder(name)
        self._engine = engine

    def chat(self, req: Any, raw: dict, ctx: Context) -> AsyncIterator[Any]:
        return self._engine(ChatChunks(req.model, ctx.id), ctx)

    def completions(self, req: Any, raw: dict, ctx: Context) -> AsyncIterator[Any]:
        raise NotImplementedError


async def burst(chunks: ChatChunks, ctx: Context) -> AsyncIterator[Any]:
    """One item, five more ready at once, a pause, one more."""
    yield chunks.delta("a")
    for ch in "bcdef":
        yield chunks.delta(ch)
    await asyncio.sleep(0.05)
    yield chunks.delta("g")
    yield chunks.delta(None, "stop")


async def odd_awaits(chunks: ChatChunks, ctx: Context) -> AsyncIterator[Any]:
    """Awaits every kind of thing an engine may await between items."""
    loop = asyncio.get_running_loop()
    yield chunks.delta("1")
    await asyncio.sleep(0)  # a bare yield
    yield chunks.delta("2")
    failing: asyncio.Future[None] = loop.create_future()
    loop.call_later(0.01, failing.set_exception, RuntimeError("device hiccup"))
    try:
        await failing
    except RuntimeError:
        yield chunks.delta("3")
    try:
        async with asyncio.timeout(0.02):  # cancels the task running us, then turns that into TimeoutError
            await loop.create_future()
    except TimeoutError:
        yield chunks.delta("4")
    yield chunks.delta(str(await loop.run_in_executor(None, lambda: 5)))
    inner = loop.create_task(asyncio.sleep(0.01, result="6"))
    yield chunks.delta(await asyncio.shield(inner))
    yield chunks.delta(None, "stop")


async def big(chunks: ChatChunks, ctx: Context) -> AsyncIterator[Any]:
    """Many items with no wait between them: the writer sends them in batches of at most 256."""
    yield chunks.delta("start:")
    for i in range(BIG_ITEMS):
        yield chunks.delta(f"{i:06d}" + "x" * 200)
    yield chunks.delta(None, "stop")


class Huge:
    """Like ``big`` with HUGE_ITEMS items; counts how many the writer pulled."""

    def __init__(self) -> None:
        self.pulled = 0

    async def __call__(self, chunks: ChatChunks, ctx: Context) -> AsyncIterator[Any]:
        yield chunks.delta("start:")
        for i in range(HUGE_ITEMS):
            self.pulled = i + 1
            yield chunks.delta(f"{i:06d}" + "x" * 200)
        yield chunks.delta(None, "stop")


class Hanging:
    """Sends one item, then waits forever; records how its wait ended."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.how: str | None = None
        self.ctx: Context | None = None

    async def __call__(self, chunks: ChatChunks, ctx: Context) -> AsyncIterator[Any]:
        self.ctx = ctx
        yield chunks.delta("only")
        await asyncio.sleep(0)  # the first item has left once the writer waits on the next
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.how = "cancelled"
            raise
        finally:
            self.ended.set()


@pytest.fixture
async def hanging() -> Hanging:
    return Hanging()


@pytest.fixture
async def huge() -> Huge:
    return Huge()


@pytest.fixture
async def service(hanging: Hanging, huge: Huge) -> AsyncIterator[HttpService]:
    manager = ModelManager()
    for name, engine in (("burst", burst), ("odd", odd_awaits), ("big", big), ("hang", hanging), ("huge", huge)):
        manager.add(StandIn(name, engine))
    svc = HttpService(manager, metrics=FrontendMetrics("test_stream_writer"))
    await svc.start("127.0.0.1", 0)
    yield svc
    await svc.stop(grace=1)


def body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


async def raw_chunks(port: int, model: str) -> list[bytes]:
    """The HTTP/1.1 chunks of a streamed answer, as framed on the wire."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = body(model)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    chunks = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        chunks.append(data[:-2])
    writer.close()
    return chunks


OPENING = {"role": "assistant", "content": ""}  # a chat stream's role-only first chunk (llm/chunks.py)


def contents(data: bytes) -> list[str]:
    """The content of each chunk event, the role-only opening chunk left out."""
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {"):
            delta = json.loads(event[6:])["choices"][0]["delta"]
            if delta != OPENING:
                out.append(delta.get("content") or "")
    return out


async def test_items_ready_together_leave_in_one_chunk_and_a_late_one_on_its_own(service: HttpService):
    chunks = await raw_chunks(service.port, "burst")
    assert [contents(c) for c in chunks] == [["a", "b", "c", "d", "e", "f"], ["g", ""]]
    assert chunks[-1].endswith(b"data: [DONE]\n\n")


async def test_whatever_the_engine_awaits_it_gets_as_under_a_task(service: HttpService):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.port}", timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", content=body("odd"),
                                 headers={"Content-Type": "application/json"}) as r:
            data = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1])
    assert text == "123456"


async def test_a_long_backlog_arrives_whole_and_in_order_across_batches(service: HttpService):
    chunks = await raw_chunks(service.port, "big")
    items = [c for chunk in chunks for c in contents(chunk)]
    assert items[0] == "start:" and items[-1] == ""
    assert [int(c[:6]) for c in items[1:-1]] == list(range(BIG_ITEMS))
    assert len(chunks) > 2  # batched, not one write per item, nor everything at once


async def test_a_client_that_leaves_cancels_the_engine_wait(service: HttpService, hanging: Hanging):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    payload = body("hang")
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await reader.readuntil(b'"only"')  # the first item arrived
    writer.close()
    await asyncio.wait_for(hanging.ended.wait(), 5)
    assert hanging.how == "cancelled"
    assert hanging.ctx is not None and hanging.ctx.is_killed


async def test_an_http_1_0_client_gets_the_events_unframed_and_the_close_ends_them(service: HttpService):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    payload = body("burst")
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    rest = await asyncio.wait_for(reader.read(), 5)  # the server closes the connection at the end
    writer.close()
    assert contents(rest) == ["a", "b", "c", "d", "e", "f", "g", ""]
    assert rest.endswith(b"data: [DONE]\n\n")


def dechunk(data: bytes) -> bytes:
    """The body of a complete chunked HTTP/1.1 message body (up to its zero-size chunk)."""
    out, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[eol + 2:eol + 2 + size])
        assert data[eol + 2 + size:eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


async def test_a_slow_client_that_fills_the_socket_gets_the_stream_whole_and_others_are_served(
        service: HttpService, huge: Huge):
    """A client with a tiny receive buffer stops reading mid-stream: the socket buffers fill and the
    server's transport pauses writing. The writer must then wait (the engine is not pulled on, nothing
    piles up in memory) while the server goes on serving other requests; when the client reads again it
    gets every event once, in order, then ``[DONE]``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: sets the window
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", service.port))
        payload = body("huge")
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
        received = b""
        while b'"start:"' not in received:  # the head and the first event: the stream is under way
            received += await loop.sock_recv(sock, 1024)
        # ... and the client stops reading: wait for the server's side of its connection to pause writing
        server = service._runner.server  # type: ignore[union-attr]

        def paused() -> Any:
            return next((c for c in server.connections if c.writing_paused), None)

        conn = await until(paused, 20, "the server to pause writing to the stalled client")
        pulled = huge.pulled
        assert pulled < HUGE_ITEMS // 2, f"the writer pulled {pulled} items for a client that reads nothing"
        buffered = conn.transport.get_write_buffer_size()
        assert buffered < (1 << 20), f"{buffered} bytes piled up in the server's transport"
        # meanwhile other requests are served, streamed and not
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.port}", timeout=10) as client:
            async with client.stream("POST", "/v1/chat/completions", content=body("burst"),
                                     headers={"Content-Type": "application/json"}) as r:
                data = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
            assert data[-1] == "[DONE]"
            assert "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1]) == "abcdefg"
            models = (await client.get("/v1/models")).json()
            assert "huge" in {m["id"] for m in models["data"]}
        assert conn.writing_paused and huge.pulled == pulled  # the slow client was still stalled all along
        # now it reads everything
        while not received.endswith(b"\r\n0\r\n\r\n"):
            more = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
            assert more, "the server closed the connection before the end of the stream"
            received += more
    finally:
        sock.close()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    events = dechunk(rest)
    items = contents(events)
    assert items[0] == "start:" and items[-1] == ""
    assert [int(c[:6]) for c in items[1:-1]] == list(range(HUGE_ITEMS))
    assert events.endswith(b"data: [DONE]\n\n")
