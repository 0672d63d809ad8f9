"""What a stranger sends to an internal listener in the fuzz tests: garbage, an HTTP request, and truncated
or oversized messages of every framing the fleet speaks (a call-home frame, a multiplexed envelope, ZMTP, a
KV transfer request), each on a fresh connection; and a flood of connections held open.

Every payload goes to every listener, whatever it speaks: a listener must survive the others' framings too.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any, Awaitable, Callable

__all__ = ["FLOOD", "HUGE", "flood", "payloads", "poke"]

FLOOD = 240  # connections held open at once by :func:`flood`
HUGE = 256 * 1024 * 1024


def _zmtp_greeting() -> bytes:
    """A ZMTP 3.0 greeting with the NULL mechanism, as a subscriber without CURVE sends it."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31


def _zmtp_ready() -> bytes:
    name, value = b"Socket-Type", b"SUB"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return bytes([0x04, len(body)]) + body


def payloads() -> dict[str, bytes]:
    greeting = _zmtp_greeting()
    return {
        "garbage": os.urandom(4096),
        "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "http announcing a body": b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\nabc",
        "call-home frame cut short": struct.pack(">QQQ", 40, 0, 0) + b'{"stream',
        "call-home frame of 256 MiB": struct.pack(">QQQ", HUGE, 0, 0) + b"x" * 100,
        "envelope of 256 MiB": struct.pack(">QQ", 1, HUGE) + b"x" * 100,
        "half a ZMTP greeting": greeting[:20],
        "ZMTP frame of 256 MiB": greeting + _zmtp_ready() + b"\x02" + struct.pack(">Q", HUGE) + b"\x01" * 100,
        "ZMTP frame of 2^62 bytes": greeting + _zmtp_ready() + b"\x02" + struct.pack(">Q", 1 << 62) + b"\x01" * 100,
        "KV transfer request cut short": b"DKVP" + struct.pack(">H", 200) + b"key",
        "KV transfer request for no key": b"DKVP" + struct.pack(">H", 5) + b"nokey",
    }


async def poke(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """Send ``data`` on a fresh connection; what comes back within 2 s (or until closed)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except (OSError, asyncio.TimeoutError):
        return b""
    got = b""
    try:
        writer.write(data)
        await writer.drain()
        got = await asyncio.wait_for(reader.read(1 << 20), 2)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        writer.close()
    return got


async def flood(ports: list[int], meanwhile: Callable[[], Awaitable[Any]], host: str = "127.0.0.1") -> None:
    """Hold :data:`FLOOD` connections open over ``ports`` (every other one having sent the start of a
    payload) while ``meanwhile()`` runs; then close them all."""
    partial = list(payloads().values())
    held = []
    try:
        for i in range(FLOOD):
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, ports[i % len(ports)]), 5)
            except (OSError, asyncio.TimeoutError):
                continue
            if i % 2:
                writer.write(partial[i % len(partial)][:30])
            held.append(writer)
        assert len(held) > FLOOD * 0.9, f"only {len(held)} of {FLOOD} connections were accepted"
        await meanwhile()
    finally:
        for w in held:
            w.close()
