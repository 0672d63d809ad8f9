"""A subscription is on the server before the code that made it tells anyone.

The server here is a few lines of the NATS text protocol that records what it has read when it answers a
PING: nats-server reads a connection in order, so a SUB it had not read when it sent the PONG was not in
place yet, and a request from another connection in that gap met "no responders".
"""

from __future__ import annotations

import asyncio

import nats

from dynamo.runtime.nats_conn import subscriptions_live


class RecordingServer:
    def __init__(self) -> None:
        self.read: list[str] = []
        self.seen_at_pong: list[list[str]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"rec","version":"2.10.0","headers":true,"max_payload":1048576,'
                     b'"proto":1}\r\n')
        while line := await reader.readline():
            verb = line.split()[0].decode().upper() if line.strip() else ""
            self.read.append(verb)
            if verb == "PING":
                self.seen_at_pong.append(list(self.read))
                writer.write(b"PONG\r\n")
            elif verb in ("PUB", "HPUB"):  # skip the payload line
                await reader.readline()
            await writer.drain()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_subscriptions_are_read_by_the_server_before_it_returns():
    server = RecordingServer()
    port = await server.start()
    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    try:
        for i in range(5):
            await nc.subscribe(f"svc.ep{i}", queue="q")
            await subscriptions_live(nc)
            last = server.seen_at_pong[-1]
            assert last.count("SUB") == i + 1, f"the server answered before reading the SUB: {last}"
    finally:
        await nc.close()
        await server.stop()
