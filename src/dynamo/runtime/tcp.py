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
import ipaddress
import socket
from dataclasses import dataclass

TRANSPORT_NAME = "tcp_server"
LIVENESS_TICKS = 4  # the client checks its streams LIVENESS_TICKS times per liveness bound
HEARTBEATS_PER_BOUND = 5  # the worker is asked for a heartbeat every bound / HEARTBEATS_PER_BOUND
CALL_HOME_TIMEOUT = 10.0  # a worker's connect to the client's listener
# A Dynamo 1.x worker sends no heartbeats: a stream of one that has sent its first token and then nothing for
# this long is treated as frozen (its host cut off, SIGSTOP). Longer than our bound since nothing but the
# tokens themselves says it is alive: a long gap between tokens (a preempted sequence) must not count.
DEFAULT_SILENCE_1X = 30.0
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


LOOPBACK = "127.0.0.1"
ANY_ADDRESS = "0.0.0.0"
ONE_MACHINE = "one machine"  # ListenHosts.why of the loopback default
_WILDCARDS = frozenset(("", "*", "0.0.0.0", "::", "[::]"))


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, ``localhost``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ListenHosts:
    """Where this process's internal listeners bind, and the address it gives out for them.

    Why one decision for all of them: the request plane, the response-stream listener and the event
    publisher carry the same users' prompts and take no credentials, so they are reachable from exactly
    the same places; the start-up line names them together.
    """

    bind: str  # the request plane's listener and the event publisher (``0.0.0.0``: every interface)
    callhome: str  # the response-stream listener
    advertise: str  # the address other processes dial, in discovery and in requests' connection info
    why: str  # for the start-up line

    @property
    def loopback(self) -> bool:
        return is_loopback(self.bind) and is_loopback(self.callhome)


def listen_hosts(configured: str | None, *, one_machine: bool) -> ListenHosts:
    """The hosts for ``DYN_TCP_RPC_HOST`` (``configured``) and a fleet on one machine or several.

    On one machine (file discovery) nothing needs to reach the planes from elsewhere, so they listen on
    loopback only; ``DYN_TCP_RPC_HOST`` opens them to another address (a wildcard binds every interface
    and advertises the host name's address). With etcd, processes on other machines dial them, so they
    stay reachable as before: the request plane and the publisher on every interface, the response
    streams on the host name's address.
    """
    if configured:
        if configured in _WILDCARDS:
            bind = ANY_ADDRESS if configured in ("", "*") else configured
            return ListenHosts(bind, bind, advertise_host(None), "DYN_TCP_RPC_HOST")
        return ListenHosts(configured, configured, configured, "DYN_TCP_RPC_HOST")
    if one_machine:
        return ListenHosts(LOOPBACK, LOOPBACK, LOOPBACK, ONE_MACHINE)
    advertise = advertise_host(None)
    if is_loopback(advertise):  # the host name resolves to loopback: nobody on another machine calls back
        return ListenHosts(ANY_ADDRESS, advertise, advertise,
                           f"a fleet across machines, but the host name {socket.gethostname()!r} resolves to "
                           f"loopback: processes on other machines cannot reach this one's response streams; "
                           f"set DYN_TCP_RPC_HOST to its address")
    return ListenHosts(ANY_ADDRESS, advertise, advertise, "a fleet across machines")


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` from a connection info, as (host, port) to dial."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``port`` of ``host`` (an address or a name; port 0: an ephemeral one)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    family, _, _, _, addr = infos[0]
    return socket.create_server(addr, family=family, backlog=1024)
