"""TLS on the TCP request plane and the response streams, with Dynamo 1.x's settings and their meanings.

Why 1.x's variables rather than our own: a fleet that mixes 1.x's processes with ours is secured once, by
one set of ``DYN_TCP_TLS_*`` variables every process reads (1.x's own docs tell an operator to set them on
every pod). They split by role, as 1.x splits them:

* a process that *accepts* connections (a worker's request-plane listener, a client's response-stream
  listener) serves TLS when ``DYN_TCP_TLS_CERT_PATH`` and ``DYN_TCP_TLS_KEY_PATH`` are set, and with
  ``DYN_TCP_TLS_CLIENT_CA_CERT_PATH`` requires a client certificate signed by that CA (mutual TLS);
* a process that *dials* (a client sending a request, a worker calling home) speaks TLS when any of
  ``DYN_TCP_TLS_CA_CERT_PATH``, ``DYN_TCP_TLS_INSECURE``, ``DYN_TCP_TLS_CLIENT_CERT_PATH`` /
  ``_KEY_PATH`` is set; it then needs the CA (or insecure mode), verifies the peer's certificate for
  ``DYN_TCP_TLS_SERVER_NAME`` or else the dialed host, and presents the client certificate when given;
* every handshake is bounded by ``DYN_TCP_TLS_HANDSHAKE_TIMEOUT_SECS`` (3 s by default, as 1.x).

Nothing in discovery says which peers speak TLS, so a fleet is TLS on these planes or plain on them,
everywhere. A setting that cannot work (a certificate without its key, a file that is missing or not PEM,
client TLS without a CA or insecure mode) stops the process at start-up in one line naming it.

The settings are read once per process (1.x builds its connector once too); :func:`reset` drops them for
tests that change the environment. The fleet secret's handshake, when set, runs inside the TLS session.
What 1.x does beyond this (re-reading a rotated certificate from disk every 30 s) is not done here: a
rotated certificate needs a restart.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from functools import cache
from typing import Any

from .errors import RuntimeConfigError
from .tls import client_context

log = logging.getLogger(__name__)

CERT = "DYN_TCP_TLS_CERT_PATH"
KEY = "DYN_TCP_TLS_KEY_PATH"
CLIENT_CA = "DYN_TCP_TLS_CLIENT_CA_CERT_PATH"
CA = "DYN_TCP_TLS_CA_CERT_PATH"
INSECURE = "DYN_TCP_TLS_INSECURE"
CLIENT_CERT = "DYN_TCP_TLS_CLIENT_CERT_PATH"
CLIENT_KEY = "DYN_TCP_TLS_CLIENT_KEY_PATH"
SERVER_NAME = "DYN_TCP_TLS_SERVER_NAME"
HANDSHAKE_TIMEOUT = "DYN_TCP_TLS_HANDSHAKE_TIMEOUT_SECS"
VARIABLES = (CERT, KEY, CLIENT_CA, CA, INSECURE, CLIENT_CERT, CLIENT_KEY, SERVER_NAME, HANDSHAKE_TIMEOUT)
DEFAULT_HANDSHAKE_TIMEOUT = 3.0


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _truthy(name: str) -> bool:
    return (_env(name) or "").lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TcpTls:
    """This process's TLS on the TCP planes: a context per role (None: that role is plaintext)."""

    server: ssl.SSLContext | None
    client: ssl.SSLContext | None
    server_name: str | None  # checked instead of the dialed host
    handshake_timeout: float

    def dial_options(self, host: str) -> dict[str, Any]:
        """Keyword arguments for ``loop.create_connection`` to ``host``: none when dialing is plaintext."""
        if self.client is None:
            return {}
        return {"ssl": self.client, "server_hostname": self.server_name or host,
                "ssl_handshake_timeout": self.handshake_timeout}

    @property
    def mutual(self) -> bool:
        """Listeners require a client certificate: a stranger cannot use them."""
        return self.server is not None and self.server.verify_mode == ssl.CERT_REQUIRED

    def describe(self) -> str:
        """For the start-up line: what each role does (empty when neither does TLS)."""
        if self.server is None and self.client is None:
            return ""
        serve = "off" if self.server is None else (
            "mutual" if self.mutual else "on")
        dial = "off" if self.client is None else (
            "insecure" if self.client.verify_mode == ssl.CERT_NONE else "on")
        return f"TLS on the TCP planes: serving {serve}, dialing {dial}"


PLAIN = TcpTls(None, None, None, DEFAULT_HANDSHAKE_TIMEOUT)


def from_env() -> TcpTls:
    """The settings as the environment gives them; a setting that cannot work is a RuntimeConfigError."""
    timeout = DEFAULT_HANDSHAKE_TIMEOUT
    if (raw := _env(HANDSHAKE_TIMEOUT)) is not None:
        try:
            timeout = float(int(raw))
        except ValueError:
            timeout = 0.0
        if timeout <= 0:
            raise RuntimeConfigError(f"{HANDSHAKE_TIMEOUT}={raw!r}: use a whole number of seconds above 0")
    return TcpTls(_server_context(), _client_context(), _env(SERVER_NAME), timeout)


def _server_context() -> ssl.SSLContext | None:
    cert, key, client_ca = _env(CERT), _env(KEY), _env(CLIENT_CA)
    if cert is None and key is None:
        if client_ca is not None:
            raise RuntimeConfigError(f"{CLIENT_CA} is set without {CERT} and {KEY}: a listener verifies client "
                                     "certificates only when it serves TLS itself")
        return None
    if cert is None or key is None:
        given, missing = (CERT, KEY) if key is None else (KEY, CERT)
        raise RuntimeConfigError(f"{given} is set without {missing}: set both to serve TLS on the TCP planes")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise RuntimeConfigError(f"{CERT}={cert} / {KEY}={key}: {exc.filename or cert}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise RuntimeConfigError(f"{CERT}={cert} / {KEY}={key}: not a matching PEM certificate and key "
                                 f"({getattr(exc, 'reason', None) or exc})") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except FileNotFoundError:
            raise RuntimeConfigError(f"{CLIENT_CA}={client_ca}: no such file") from None
        except (ssl.SSLError, OSError) as exc:
            raise RuntimeConfigError(f"{CLIENT_CA}={client_ca}: not a readable PEM CA certificate "
                                     f"({getattr(exc, 'reason', None) or exc})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client_context() -> ssl.SSLContext | None:
    ca, insecure, cert, key = _env(CA), _truthy(INSECURE), _env(CLIENT_CERT), _env(CLIENT_KEY)
    if ca is None and not insecure and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise RuntimeConfigError(f"both {CLIENT_CERT} and {CLIENT_KEY} must be set to present a client certificate")
    if ca is None and not insecure:
        raise RuntimeConfigError(f"TLS on the TCP planes is asked for ({CLIENT_CERT}), but neither {CA} (the CA "
                                 f"that signed the peers' certificates) nor {INSECURE}=1 (development only) is set")
    ctx = client_context(ca=ca, cert=cert, key=key, names=(CA, CLIENT_CERT, CLIENT_KEY), insecure=insecure)
    if insecure:
        log.warning("%s is set: peers' certificates on the TCP planes are not verified (development only)",
                    INSECURE)
    return ctx


@cache
def settings() -> TcpTls:
    """This process's settings, read from the environment once."""
    return from_env()


def reset() -> None:
    """Read the environment again at the next :func:`settings` (tests that change it)."""
    settings.cache_clear()


class TlsDialError(ConnectionError):
    """A dialed peer and this process did not agree on TLS (plaintext peer, untrusted certificate, ...)."""


def handshake_reason(exc: BaseException) -> str:
    """One line for a failed handshake, naming the likely cause."""
    if isinstance(exc, (TimeoutError, ConnectionAbortedError)):
        return "no TLS handshake in time (a plaintext peer? its DYN_TCP_TLS_* settings may be missing)"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate not trusted: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or str(exc)).lower().replace("_", " ")
        if "eof occurred" in reason or "unexpected eof" in reason:
            return f"{reason} (the peer closed the connection: a plaintext listener, or it refused our certificate)"
        if "wrong version number" in reason or "http request" in reason or "record layer failure" in reason:
            return f"{reason} (a plaintext peer: set its DYN_TCP_TLS_* settings)"
        if "certificate required" in reason or "peer did not return a certificate" in reason:
            return f"{reason} (this listener requires a client certificate: DYN_TCP_TLS_CLIENT_CERT_PATH)"
        return reason
    return str(exc) or type(exc).__name__


def acceptor_options(what: str) -> dict[str, Any]:
    """Keyword arguments for a listener's :class:`dynamo.aio.Acceptor`: TLS when this process serves it, and
    one warning line for each failed handshake, naming the peer and the likely cause (the loop itself says
    nothing of it); the listener keeps serving."""
    tls = settings()
    if tls.server is None:
        return {}

    def failed(peer: Any, exc: BaseException) -> None:
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a peer"
        log.warning("%s: TLS handshake with %s failed: %s", what, where, handshake_reason(exc))

    return {"ssl": tls.server, "ssl_handshake_timeout": tls.handshake_timeout, "on_failure": failed}
