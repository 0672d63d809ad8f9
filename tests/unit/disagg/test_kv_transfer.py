"""The KV state transfer between a prefill and a decode worker: intact, or a TransferError."""

import asyncio
import hashlib
import os

import pytest

from dynamo.disagg.transfer import (
    ExportStore,
    Ticket,
    TransferError,
    TransferServer,
    encode_response,
    pull,
)


def _ticket(address: str, key: str, data: bytes) -> Ticket:
    return Ticket(address=address, key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                  n_tokens=7, first_token=42)


async def _server(store: ExportStore, chunk: int = 4096) -> TransferServer:
    srv = TransferServer(store, chunk=chunk)
    await srv.start()
    return srv


async def test_roundtrip_in_chunks_and_a_state_is_pulled_once():
    store = ExportStore(max_bytes=1 << 20)
    srv = await _server(store)
    try:
        data = os.urandom(100_000)  # 25 chunks of 4 KiB
        key, digest = store.put(data)
        t = Ticket(srv.address, key, len(data), digest, 7, 42)
        assert Ticket.from_dict(t.to_dict()) == t
        assert await pull(t) == data
        assert len(store) == 0 and store.bytes == 0
        with pytest.raises(TransferError, match="no longer holds"):
            await pull(t)
    finally:
        await srv.close()


async def _forging_server(frames: list[bytes], close_early: bool = False):
    async def serve(reader, writer):
        await reader.readexactly(6)
        for f in frames:
            writer.write(f)
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop_chunk", "wrong_digest", "short_header"])
async def test_damaged_transfers_are_detected(damage):
    data = os.urandom(20_000)
    digest = hashlib.sha256(data).hexdigest()
    frames = encode_response(data, digest, chunk=4096)
    if damage == "flip":
        f = bytearray(frames[2])
        f[100] ^= 0x01
        frames[2] = bytes(f)
    elif damage == "truncate":
        frames = frames[:3] + [frames[3][:1000]]
    elif damage == "drop_chunk":
        del frames[2]
    elif damage == "wrong_digest":
        frames = encode_response(data, hashlib.sha256(b"other").hexdigest(), chunk=4096)
    elif damage == "short_header":
        frames = [frames[0][:10]]
    srv, addr = await _forging_server(frames)
    try:
        with pytest.raises(TransferError):
            await pull(_ticket(addr, "k", data), timeout=5)
    finally:
        srv.close()


async def test_same_length_corruption_behind_valid_crcs_fails_the_digest():
    data = os.urandom(10_000)
    other = bytearray(data)
    other[5] ^= 0xFF
    # frames carry correct crc32s for the altered bytes, but the header's sha256 is the original's
    frames = encode_response(bytes(other), hashlib.sha256(data).hexdigest(), chunk=4096)
    srv, addr = await _forging_server(frames)
    try:
        with pytest.raises(TransferError, match="sha256"):
            await pull(_ticket(addr, "k", data), timeout=5)
    finally:
        srv.close()


async def test_oversized_state_is_refused_before_reading_it():
    data = os.urandom(50_000)
    srv, addr = await _forging_server(encode_response(data, hashlib.sha256(data).hexdigest()))
    try:
        with pytest.raises(TransferError, match="exceeds the limit"):
            await pull(_ticket(addr, "k", data), timeout=5, max_bytes=10_000)
    finally:
        srv.close()


async def test_dead_prefill_worker_and_silent_one_are_errors_not_hangs():
    # nothing listens: refused at once
    s = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = s.sockets[0].getsockname()[1]
    s.close()
    await s.wait_closed()
    with pytest.raises(TransferError, match="failed"):
        await pull(_ticket(f"127.0.0.1:{port}", "k", b"x"), timeout=5)
    # a peer that accepts and never answers (SIGSTOPped worker): the timeout ends it
    never = asyncio.Event()

    async def mute(reader, writer):
        await never.wait()

    srv = await asyncio.start_server(mute, "127.0.0.1", 0)
    try:
        with pytest.raises(TransferError, match="timed out"):
            await pull(_ticket(f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "k", b"x"), timeout=0.3)
    finally:
        never.set()
        srv.close()


async def test_slow_reader_bounds_the_writers_buffer():
    """Back-pressure: a reader that stops reading leaves at most a few chunks queued at the writer."""
    store = ExportStore(max_bytes=64 << 20)
    srv = await _server(store, chunk=64 * 1024)
    data = os.urandom(16 << 20)
    key, digest = store.put(data)
    host, _, port = srv.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=64 * 1024)
    writer.transport.set_write_buffer_limits(0)
    try:
        writer.write(b"DKVP" + len(key).to_bytes(2, "big") + key.encode())
        await reader.readexactly(45)  # response header; then stop reading
        # a negative (the writer did not finish) needs a grace period; without drain() the server would
        # have queued all 16 MiB and counted the state served within a few milliseconds
        await asyncio.sleep(0.3)
        assert srv.served == 0
        # read the rest: it completes
        rest = await reader.read(-1)
        assert len(rest) > len(data)
        assert srv.served == 1
    finally:
        writer.close()
        await srv.close()


def test_export_store_is_bounded_oldest_first_and_expires():
    now = [0.0]
    store = ExportStore(max_bytes=100, ttl=10, clock=lambda: now[0])
    k1, _ = store.put(b"a" * 40)
    k2, _ = store.put(b"b" * 40)
    k3, _ = store.put(b"c" * 40)  # evicts k1
    assert store.take(k1) is None and store.evicted == 1
    assert store.take(k2)[0] == b"b" * 40
    now[0] = 11.0
    assert store.take(k3) is None and store.bytes == 0
    with pytest.raises(TransferError, match="exceeds"):
        store.put(b"x" * 101)


def test_malformed_ticket():
    with pytest.raises(TransferError):
        Ticket.from_dict({"address": "h:1"})


async def test_with_a_fleet_secret_only_a_member_pulls_a_state(caplog):
    caplog.set_level("DEBUG", logger="dynamo.runtime.fleet_auth")  # a repeat within the minute is at debug
    from dynamo.runtime.fleet_auth import FleetAuth

    member, stranger = FleetAuth(b"the fleet's secret for KV transfer"), FleetAuth(b"another fleet's secret, KV")
    store = ExportStore(max_bytes=1 << 20)
    srv = TransferServer(store, chunk=4096, auth=member)
    await srv.start()
    try:
        data = os.urandom(50_000)
        key, digest = store.put(data)
        t = Ticket(srv.address, key, len(data), digest, 7, 42)
        for auth in (stranger, None):  # another secret, or none: no state, and the key was never read
            with pytest.raises(TransferError):
                await pull(t, timeout=5, auth=auth)
            assert len(store) == 1
        assert "KV transfer: refused a connection from 127.0.0.1" in caplog.text
        assert await pull(t, auth=member) == data
        assert srv.served == 1
    finally:
        await srv.close()


@pytest.mark.parametrize("secret", [None, b"the fleet's secret for KV transfer"], ids=["no-secret", "secret"])
async def test_strangers_bytes_and_a_flood_leave_the_transfer_server_serving(secret):
    """Garbage, an HTTP request, truncated and oversized messages of every framing the fleet speaks, and a
    flood of connections held open: a state put before them is still pulled whole, while the flood is held
    and after."""
    from dynamo.runtime.fleet_auth import FleetAuth
    from harness.strangers import flood, payloads, poke

    auth = FleetAuth(secret) if secret else None
    store = ExportStore(max_bytes=1 << 20)
    srv = TransferServer(store, chunk=4096, auth=auth)
    await srv.start()
    port = int(srv.address.rsplit(":", 1)[1])
    try:
        data = [os.urandom(30_000) for _ in range(2)]
        tickets = [_ticket(srv.address, store.put(d)[0], d) for d in data]
        await asyncio.gather(*(poke(port, p) for p in payloads().values()))

        async def pull_first() -> None:
            assert await pull(tickets[0], timeout=5, auth=auth) == data[0]

        await flood([port], pull_first)
        assert await pull(tickets[1], timeout=5, auth=auth) == data[1]
        assert srv.served == 2
    finally:
        await srv.close()
