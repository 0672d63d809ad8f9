"""Which TCP ports a process listens on, and on which address, read from ``/proc`` (Linux).

Why ``/proc`` rather than dialing the machine's other addresses: a test may only send loopback traffic,
and a socket bound to ``0.0.0.0`` answers on loopback too, so only the kernel's table tells a loopback
listener from one every interface reaches. The process's socket inodes (``/proc/<pid>/fd``) pick its own
rows out of ``/proc/<pid>/net/tcp`` and ``tcp6``; threads share the table, so ZMQ's I/O thread's
sockets are included.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from pathlib import Path
from typing import NamedTuple

__all__ = ["Listening", "listening_sockets", "proc_net_available"]

_LISTEN = "0A"


class Listening(NamedTuple):
    host: str  # "127.0.0.1", "0.0.0.0", "::", "::1", ...
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


def proc_net_available() -> bool:
    return sys.platform.startswith("linux") and Path(f"/proc/{os.getpid()}/net/tcp").exists()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _decode(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])  # one little-endian 32-bit word
    words = struct.unpack("<4I", raw)  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening_sockets(pid: int) -> set[Listening]:
    """Every TCP socket of process ``pid`` in the LISTEN state, as (address, port)."""
    inodes = _socket_inodes(pid)
    found = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != _LISTEN or inode not in inodes:
                continue
            host, port = local.split(":")
            found.add(Listening(_decode(host, v6), int(port, 16)))
    return found
