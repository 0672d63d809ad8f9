"""etcd's JSON gRPC-gateway as the etcd client and its watches both speak it: base64 keys and values,
prefix ranges, the error types, and one-line descriptions of connection failures.

Kept apart from :mod:`.etcd` (requests) and :mod:`.etcd_watch` (streams) so that both can use it
without importing each other.
"""

from __future__ import annotations

import asyncio
import base64
import os
import ssl

import aiohttp

from .discovery import KeyValue
from .errors import DynamoRuntimeError

REQUEST_TIMEOUT = 5.0
CONNECT_TIMEOUT = 3.0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with prefix": prefix with its last byte + 1."""
    buf = bytearray(prefix)
    while buf:
        if buf[-1] < 0xFF:
            buf[-1] += 1
            return bytes(buf)
        buf.pop()
    return b"\0"  # every key


def kv_from_gateway(kv: dict) -> KeyValue:
    """A key-value as the gateway returns it (base64 fields, numbers as strings)."""
    return KeyValue(
        key=unb64(kv.get("key")).decode(),
        value=unb64(kv.get("value")),
        create_revision=int(kv.get("create_revision", 0)),
        mod_revision=int(kv.get("mod_revision", 0)),
        version=int(kv.get("version", 0)),
        lease=int(kv.get("lease", 0)),
    )


class EtcdError(DynamoRuntimeError):
    """etcd answered with an error (not a connectivity problem)."""


class AuthExpired(EtcdError):
    """etcd refused our token (expired, or etcd restarted and forgot it): authenticate again."""


def is_auth_error(status: int, text: str) -> bool:
    lowered = text.lower()
    return status == 401 or "invalid auth token" in lowered or '"grpc_code":16' in lowered.replace(" ", "")


AUTH_REFUSALS = ("authentication failed", "user name is empty", "permission denied", "invalid auth token")


def auth_hint(message: str) -> str:
    """``message`` with the settings to check when etcd refused our credentials."""
    if any(r in message.lower() for r in AUTH_REFUSALS):
        return f"{message} (check ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD)"
    return message


def describe(exc: BaseException) -> str:
    """A short lowercase reason for a connection failure, e.g. 'connection refused'."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    cert_error = getattr(exc, "certificate_error", None)
    if isinstance(cert_error, ssl.SSLCertVerificationError):
        detail = cert_error.verify_message or str(cert_error)
        return f"certificate verify failed: {detail} (ETCD_AUTH_CA names the CA to trust)"
    if isinstance(exc, aiohttp.ClientSSLError):
        text = str(exc).splitlines()[0]
        if "BAD_CERTIFICATE" in text or "CERTIFICATE_REQUIRED" in text:
            return ("TLS failed: etcd refused our client certificate, or we sent none "
                    "(ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY name one signed by the CA etcd trusts)")
        return f"TLS failed: {text}"
    os_err = getattr(exc, "os_error", None) or (exc if isinstance(exc, OSError) else None)
    if isinstance(os_err, OSError):
        if os_err.errno:
            return os.strerror(os_err.errno).lower()
        if os_err.strerror:
            return os_err.strerror.lower()
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]
