"""What the open TCP planes buffer for a peer without a fleet secret. On a worker's request plane, a request
announcing more than ``MAX_REQUEST`` drops its connection from its length alone, and requests left
unfinished on many connections cannot together hold more than ``MAX_PENDING``; on a frontend's call-home
listener, envelopes left unfinished on many multiplexed connections are held to its own budget. The
connection that would pass a budget is dropped, in one log line naming the peer; the plane keeps
answering a real client."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynamo.runtime import tcp_request_plane
from dynamo.runtime.mux import pack_envelope
from dynamo.runtime.tcp_request_plane import MAX_REQUEST, TcpRequestPlane
from dynamo.runtime.v1_wire import encode_request_message
from harness.wait import until


@pytest.fixture
async def plane():
    worker = TcpRequestPlane(host="127.0.0.1")

    async def handler(request):
        await request.respond(b"")  # taken

    await worker.serve("svc", "gen", handler, PATH)
    client = TcpRequestPlane(host="127.0.0.1")
    yield worker, client
    await client.close()
    await worker.close()


PATH = "1/ns/svc/gen"


async def ask(client: TcpRequestPlane, worker: TcpRequestPlane) -> bytes:
    return await client.send(f"{worker.address}/{PATH}", b"{}", timeout=5)


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


async def test_a_request_announcing_256_mib_is_dropped_at_its_prefix(plane, caplog):
    worker, client = plane
    host, port = worker.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(encode_request_message(PATH, {}, b"")[:-4] + (256 * 1024 * 1024).to_bytes(4, "big") + b"x" * 1000)
        s.setblocking(False)
        await until(lambda: closed_by_peer(s), 5, "the worker to close the connection")
    assert worker.pending == 0
    lines = [r.getMessage() for r in caplog.records if "request plane: dropping" in r.getMessage()]
    assert len(lines) == 1 and f"a request of {256 * 1024 * 1024} bytes announced" in lines[0], lines
    assert f"at most {MAX_REQUEST}" in lines[0]
    assert await ask(client, worker) == b""


async def test_unfinished_requests_on_many_connections_stay_under_the_budget(plane, caplog, monkeypatch):
    monkeypatch.setattr(tcp_request_plane, "MAX_PENDING", 1024 * 1024)  # 1 MiB: the same rule, smaller
    worker, client = plane
    host, port = worker.address.rsplit(":", 1)
    part = 300 * 1024
    conns = []
    try:
        for _ in range(5):  # 5 x 300 KiB started, none finished: the fourth passes 1 MiB
            s = socket.create_connection((host, int(port)))
            s.sendall(encode_request_message(PATH, {}, b"y" * (2 * part))[:part])
            s.setblocking(False)
            conns.append(s)
            await asyncio.sleep(0.05)
        await until(lambda: sum(closed_by_peer(s) for s in conns) >= 2, 5, "connections over the budget dropped")
        assert worker.pending <= 1024 * 1024
        lines = [r.getMessage() for r in caplog.records if "request plane: dropping" in r.getMessage()]
        assert lines and "not yet complete on all connections would exceed 1048576 bytes" in lines[0], lines
        assert len(lines) == 1  # the same peer host: once a minute
        assert await ask(client, worker) == b""
    finally:
        for s in conns:
            s.close()
    await until(lambda: worker.pending == 0, 5, "the closed connections' bytes released")


async def test_a_frontends_call_home_listener_holds_unfinished_envelopes_to_its_budget(caplog, monkeypatch):
    """Without a fleet secret anyone may open a multiplexed call-home connection (the handshake names no
    stream); envelopes begun on many of them cannot together hold more than the listener's budget."""
    from dynamo.runtime import mux_listener
    from dynamo.runtime.mux import encode_mux_handshake
    from dynamo.runtime.tcp_listener import TcpResponseServer

    monkeypatch.setattr(mux_listener, "MAX_PENDING", 1024 * 1024)
    server = TcpResponseServer("127.0.0.1")
    await server.start()
    host, port = server.address.rsplit(":", 1)
    conns = []
    try:
        for _ in range(5):  # 5 x 300 KiB of envelopes that never end: the fourth passes 1 MiB
            s = socket.create_connection((host, int(port)))
            s.sendall(encode_mux_handshake(None) + pack_envelope(7, 10 * 1024 * 1024) + b"z" * (300 * 1024))
            s.setblocking(False)
            conns.append(s)
            await asyncio.sleep(0.05)
        await until(lambda: sum(closed_by_peer(s) for s in conns) >= 2, 5, "connections over the budget dropped")
        assert server.pending_bytes <= 1024 * 1024
        lines = [r.getMessage() for r in caplog.records if "response streams: dropping" in r.getMessage()]
        assert len(lines) == 1 and "would exceed 1048576 bytes" in lines[0], lines
    finally:
        for s in conns:
            s.close()
    await until(lambda: server.pending_bytes == 0, 5, "the closed connections' bytes released")
    await server.close()
