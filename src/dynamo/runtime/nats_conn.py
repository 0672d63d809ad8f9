"""Connecting to NATS with a bounded, clearly reported failure.

nats-py retries an unreachable server forever and logs a traceback per try, so we probe the TCP address
first (a one-line error within seconds) and bound the real connect with a timeout.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import ssl
import time
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client as NatsClient

from .config import NatsSettings
from .errors import RuntimeConfigError, RuntimeConnectionError
from .tls import client_context

log = logging.getLogger(__name__)


class _SslEofNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" for every TLS
    connection nats-py opens (its protocol asks to keep half-closed sockets, which TLS cannot): a line per
    connection attempt that says nothing to an operator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_SslEofNoise())

CONNECT_TIMEOUT = 3.0


def redact_url(url: str) -> str:
    """The URL without credentials, for messages."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return f"{parts.scheme}://{host}{parts.path}"
    return url


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message or exc} (NATS_TLS_CA_CERT_PATH names the CA to trust)"
    if isinstance(exc, ssl.SSLError):
        if exc.reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE"):
            return ("TLS failed: the server refused our client certificate, or we sent none "
                    "(NATS_TLS_CLIENT_CERT_PATH and NATS_TLS_CLIENT_KEY_PATH name one signed by the CA it trusts)")
        return f"TLS failed: {exc.reason or exc}".lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    text = (str(exc) or type(exc).__name__).splitlines()[0]
    if "authorization violation" in text.lower():
        return f"{text.strip()} (check NATS_AUTH_* or the URL's credentials)"
    return text


def _dropped_after_handshake(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE))


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """The TLS context for ``settings`` (None: plain TCP). TLS settings need a tls:// URL, as in Dynamo 1.x:
    a nats:// URL would only use TLS if the server asked, so a setting could silently do nothing."""
    wants = settings.tls_ca or settings.tls_cert or settings.tls_key or settings.tls_insecure
    if not settings.server.startswith("tls://"):
        if wants:
            raise RuntimeConfigError(
                f"NATS_TLS_* is set but NATS_SERVER={redact_url(settings.server)} is not a tls:// URL: "
                "use tls://host:port to connect to NATS over TLS")
        return None
    if settings.tls_insecure:
        log.warning("NATS_TLS_INSECURE: the NATS server's certificate is not verified (development only)")
    return client_context(ca=settings.tls_ca, cert=settings.tls_cert, key=settings.tls_key,
                          insecure=settings.tls_insecure,
                          names=("NATS_TLS_CA_CERT_PATH", "NATS_TLS_CLIENT_CERT_PATH", "NATS_TLS_CLIENT_KEY_PATH"))


async def _probe(url: str, timeout: float) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 4222
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise RuntimeConnectionError(f"cannot reach NATS at {redact_url(url)}: {_reason(exc)}") from None
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def connect_nats(settings: NatsSettings, *, name: str = "dynamo", timeout: float = CONNECT_TIMEOUT) -> NatsClient:
    """Connect to ``settings.server`` (``nats://[user:pass@|token@]host:port``) with env credentials."""
    url = settings.server
    if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
        raise RuntimeConnectionError(f"invalid NATS_SERVER {url!r}: must start with nats://")
    tls = tls_context(settings)
    await _probe(url, timeout)

    last_error: list[BaseException] = []
    client: list[NatsClient] = []  # set once connected: the callbacks below ask it what state it is in
    lost_at: list[float] = []

    async def on_error(exc: Exception) -> None:
        last_error.append(exc)
        log.debug("nats error: %s", exc)

    # One line per transition (retries log at debug), so an operator can tell "NATS was away" from "the
    # workers were away" when requests fail around a NATS restart.
    async def on_disconnected() -> None:
        if client and client[0].is_reconnecting and not lost_at:
            lost_at.append(time.monotonic())
            log.warning("NATS connection to %s lost; reconnecting", redact_url(url))

    async def on_reconnected() -> None:
        away = time.monotonic() - lost_at.pop() if lost_at else 0.0
        log.info("NATS at %s reconnected after %.1fs", redact_url(url), away)

    options: dict = dict(
        name=name,
        connect_timeout=timeout,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        allow_reconnect=True,
        max_reconnect_attempts=-1,  # after the first connect, ride out NATS restarts
        reconnect_time_wait=0.5,
        pending_size=64 * 1024 * 1024,
        flush_timeout=10,
    )
    if settings.username:
        options["user"] = settings.username
        options["password"] = settings.password or ""
    if settings.token:
        options["token"] = settings.token
    if settings.nkey_seed:
        options["nkeys_seed_str"] = settings.nkey_seed
    if settings.credentials_file:
        options["user_credentials"] = settings.credentials_file
    if tls is not None:
        options["tls"] = tls
    try:
        nc = await asyncio.wait_for(nats.connect(url, **options), timeout)
    except (asyncio.TimeoutError, Exception) as exc:
        # a refused credential is the reason even when a later try only saw the connection drop
        refusals = [e for e in last_error if "authorization" in str(e).lower()]
        cause = refusals[-1] if refusals else last_error[-1] if last_error else exc
        reason = _reason(cause)
        if tls is not None and not settings.tls_cert and _dropped_after_handshake(cause):
            # TLS 1.3: a server that requires a client certificate says so after our side of the handshake
            # has finished, so the alert races the drop and we may only see the connection go
            reason += (" (a server that requires client certificates drops a client without one: "
                       "NATS_TLS_CLIENT_CERT_PATH and NATS_TLS_CLIENT_KEY_PATH name one signed by the CA it trusts)")
        raise RuntimeConnectionError(f"cannot connect to NATS at {redact_url(url)}: {reason}") from None
    client.append(nc)
    return nc


async def subscriptions_live(nc: NatsClient) -> None:
    """Return once every subscription made so far on ``nc`` is in place on the server, so a request sent
    by another connection right after finds it.

    One ``flush()`` does not promise that in nats-py 2.16: it writes its PING straight to the socket while
    a new SUB still waits in the client's pending buffer for the flusher task, so the server can answer the
    PING before it has read the SUB, and a request from another process in between got "no responders"
    (seen once in a full test run). The first flush hands the SUB to the socket; the second PING goes out
    behind it, and its PONG comes back after the server has taken the SUB.
    """
    await nc.flush()
    await nc.flush()
