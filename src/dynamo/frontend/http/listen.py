"""The listening socket an HTTP worker process was handed by its parent (``--http-workers N``).

With ``--http-workers N`` the parent process binds N sockets to the port (``SO_REUSEPORT``) before it
forks the N HTTP worker processes; each child adopts one here and :class:`HttpService` listens on it
instead of binding its own.  A process that was not forked that way has nothing adopted and binds as
usual.  The worker's index also labels its ``/metrics`` (``http_worker``), since a scrape reaches one
process.
"""

from __future__ import annotations

import socket

_adopted: socket.socket | None = None
_index: int | None = None


def adopt(sock: socket.socket, index: int) -> None:
    """Called in an HTTP worker process, before the service starts: listen on ``sock``; we are worker ``index``."""
    global _adopted, _index
    _adopted, _index = sock, index


def take_adopted() -> socket.socket | None:
    """The adopted listening socket (once; ``None`` in a process that binds its own)."""
    global _adopted
    sock, _adopted = _adopted, None
    return sock


def worker_index() -> int | None:
    """This process's index among the HTTP workers (0..N-1), ``None`` without ``--http-workers``."""
    return _index
