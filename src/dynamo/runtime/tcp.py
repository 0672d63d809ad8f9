"""TCP call-home response streams: what both sides share (the default response transport).

The client process runs one TCP listener (:mod:`.tcp_listener`). Each request names a fresh stream key;
the worker connects back (:mod:`.tcp_callhome`), sends a handshake with that key, then the prologue, the
items, the completion marker and a sentinel. The socket doubles as the liveness signal (a dead worker
closes it, so the client knows at once) and as the channel for the client's ``stop``/``kill``. Why TCP
rather than NATS for the response leg: docs/runtime.md ("Transport").

A frozen worker (SIGSTOP, a stalled host) closes nothing, so the client also asks for heartbeats
(``heartbeat_ms`` in the connection info): the worker sends a ``"heartbeat"`` frame on a stream that had
nothing to send for that long, and the client fails a stream that was silent for its liveness bound
(:class:`StreamStalledError`). Both sides check on one periodic tick for all their streams, so liveness
costs nothing per token. TCP keepalive on every socket catches a peer host that vanished while idle.

This module holds the transport's name on the wire, its timing constants and the socket options and
addresses both sides use; it imports neither side, so each side (and the multiplexed variant,
:mod:`.mux`) can use it without a circle.
"""

from __future__ import annotations

import asyncio
import socket

TRANSPORT_NAME = "tcp_server"
LIVENESS_TICKS = 4  # the client checks its streams LIVENESS_TICKS times per liveness bound
HEARTBEATS_PER_BOUND = 5  # the worker is asked for a heartbeat every bound / HEARTBEATS_PER_BOUND
CALL_HOME_TIMEOUT = 10.0  # a worker's connect to the client's listener
_TCP_KEEPALIVE = tuple((getattr(socket, name), value) for name, value in
                       (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)) if hasattr(socket, name))


def tune_socket(transport: asyncio.BaseTransport) -> None:
    """No Nagle delay (a token leaves at once) and TCP keepalive on a stream socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # keepalive: a peer host that vanished while the stream is idle is noticed (~16 s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _TCP_KEEPALIVE:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        except OSError:
            pass


def instance_hex(instance_id: int | None) -> str:
    """An instance id as it appears in logs (unsigned hex; ``?`` when unknown)."""
    return f"{instance_id & 0xFFFFFFFFFFFFFFFF:x}" if instance_id is not None else "?"


def advertise_host(configured: str | None) -> str:
    """Address workers should dial to reach this process.

    ``DYN_TCP_RPC_HOST`` wins; otherwise the address the host name resolves to; otherwise loopback
    (correct for single-machine setups, the common case here).
    """
    if configured:
        return configured
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if addr and not addr.startswith("127."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` from a connection info, as (host, port) to dial."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def listen(host: str) -> socket.socket:
    """A listening socket on an ephemeral port of ``host`` (an address or a name)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    family, _, _, _, addr = infos[0]
    return socket.create_server(addr, family=family, backlog=1024)
