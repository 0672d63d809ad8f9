"""Which discovery backend a process uses when nobody said, and a warning when two processes chose
differently.

The rule: what was asked (``--discovery-backend``, ``DYN_DISCOVERY_BACKEND``, the settings) wins; else
etcd when ``ETCD_ENDPOINTS`` is set or an etcd answers on the default address (``localhost:2379``,
asked for its ``/version`` with a short timeout, so a user who ran ``dynamo-run-infra`` keeps today's
behaviour); else the file store, which needs nothing started. The runtime logs the choice and the
reason in one line, with the planes' (:mod:`.plane_choice`).

A rule that looks at what is running can give two processes different answers (one started before
etcd, one after). They would never find each other, silently; so a process that has seen no other
process in its store for a while checks whether the other backend is in use (etcd answering, or live
leases in the file store's directory) and says so once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from .config import RuntimeSettings

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.5  # seconds to wait for an etcd on the default address before choosing the file store
MISMATCH_AFTER = 10.0  # seconds without any other process in the store before looking at the other backend


async def etcd_answers(endpoint: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """True when an etcd answers ``GET /version`` at ``endpoint`` (plain HTTP) within ``timeout``."""
    parts = urlsplit(endpoint)
    if parts.scheme != "http":
        return False  # TLS endpoints are only used when given explicitly
    host, port = parts.hostname or "localhost", parts.port or 2379
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(f"GET /version HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), timeout)
        return b"etcdserver" in answer
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


async def choose_discovery(settings: RuntimeSettings) -> tuple[str, str]:
    """(backend, why) for this process."""
    if settings.discovery_backend:
        return settings.discovery_backend, "as asked"
    if settings.etcd.explicit:
        return "etcd", "ETCD_ENDPOINTS is set"
    endpoint = settings.etcd.endpoints[0]
    if await etcd_answers(endpoint):
        return "etcd", f"an etcd answers at {endpoint}"
    return "file", f"no etcd at {endpoint}"


def live_leases_in(root: Path) -> int:
    """How many unexpired leases the file store at ``root`` holds (0 when there is no such store)."""
    now, live = time.time(), 0
    try:
        paths = list((root / "leases").iterdir())
    except OSError:
        return 0
    for path in paths:
        try:
            if float(orjson.loads(path.read_bytes())["expires"]) > now:
                live += 1
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return live


class MismatchCheck:
    """Warns once when this process has been alone in its store for ``after`` seconds while the other
    backend is in use by someone; stops at the first sign of another process here."""

    def __init__(self, backend: str, others_here: Callable[[], Awaitable[bool]],
                 other_in_use: Callable[[], Awaitable[str | None]], after: float | None = None) -> None:
        self.backend = backend
        self.others_here = others_here  # True when another process's keys are in this store
        self.other_in_use = other_in_use  # where the other backend is in use, or None
        self.after = MISMATCH_AFTER if after is None else after
        self.warned = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.after)
            try:
                if await self.others_here():
                    return
                where = await self.other_in_use()
            except Exception as exc:  # noqa: BLE001 - a diagnostic must never take the process down
                log.debug("discovery mismatch check failed: %s", exc)
                continue
            if where:
                log.warning("discovery: this process uses the %s store and has seen no other process there for "
                            "%.0fs, but %s; processes on different discovery backends never find each other: "
                            "give them all the same --discovery-backend (or DYN_DISCOVERY_BACKEND)",
                            self.backend, self.after, where)
                self.warned = True
                return
