"""The fleet secret: who may talk on this fleet's TCP planes, proved before a single request byte is read.

Why: the request plane (a worker's listener) and the response streams (a client's call-home listener)
take requests and tokens from whoever connects. Across machines they cannot stay on loopback, so one
setting shared by every process of the fleet, ``DYN_FLEET_SECRET`` (or ``DYN_FLEET_SECRET_FILE``: a file
only its owner may read), proves that a peer belongs to the fleet. Without it nothing changes: the planes
speak their protocols from the first byte, as before.

The handshake, on every TCP connection of those planes, before the plane's own protocol (both sides
send their hello at once, so it costs one round trip after the connect, once per connection; the
request plane and the multiplexed call-home keep one connection per pair of processes):

    both ways, first:   MAGIC (16 bytes) + a fresh random nonce (32 bytes)
    both ways, then:    HMAC-SHA256(key, role || address || listener's nonce || dialer's nonce)

``key`` is derived from the secret (the secret itself never crosses the wire); ``role`` is the sender's
(``dialer`` or ``listener``), so neither side's proof can be reflected back as the other's; ``address``
is the ``host:port`` the dialer dialed, as the listener advertised it (the instance record's address, or
the connection info's). Binding the address means a process without the secret that registers its own
address in discovery cannot relay the handshake to a real worker: the worker proves itself for its own
address, not for the impostor's, and the dialer refuses before it sends a request. Proofs are compared
with :func:`hmac.compare_digest`. Each side checks the other's proof: the listener reads nothing of the
plane's protocol before the dialer's proof holds, and the dialer sends nothing before the listener's
holds. A peer that fails (another secret, none, silence past the timeout) is dropped with one log line
on each side; the listener keeps serving.

What this is not: encryption. Requests and tokens still cross the network in the clear after the
handshake, and an attacker on the path between two fleet machines could read them, or take over a
connection after it was authenticated; use a private network (or a VPN/IPsec between the machines) for
confidentiality (docs/security.md). The ZMQ event plane is encrypted too: it uses CURVE with keys
derived from the same secret (:mod:`.zmq_curve`, :meth:`FleetAuth.derive`). The disaggregated KV
transfer server runs the same handshake on its asyncio streams (:func:`handshake_streams`).

The MAGIC's first byte and its ninth are 0xff, so a process without the secret reading it as its own
protocol sees an impossible length at once (the request plane's envelope, a call-home frame) and can
say in one line that its peer has a fleet secret (:func:`is_fleet_hello`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import stat
import time
from typing import Callable, TypeVar

from . import tcp_tls
from .errors import RuntimeConfigError

log = logging.getLogger(__name__)

MAGIC = b"\xffdynamo-\xfffleet-1"  # 16 bytes
NONCE_LEN = 32
PROOF_LEN = 32
HELLO_LEN = len(MAGIC) + NONCE_LEN
# a peer without the secret: one of ours started without it, or a Dynamo 1.x process (1.x has no fleet secret:
# a fleet mixing 1.x processes runs without one; docs/runtime.md, "The TCP request plane: one wire, 1.x's")
NO_HANDSHAKE = ("it did not start the fleet-secret handshake (no DYN_FLEET_SECRET there? a Dynamo 1.x process, "
                "which has none?)")
NO_HANDSHAKE_1X = ("it sent a request without the fleet-secret handshake (no DYN_FLEET_SECRET there: one of ours "
                   "started without it, or a Dynamo 1.x frontend, which has none)")
HANDSHAKE_TIMEOUT = 10.0  # a peer that has not proved itself by then is dropped
MIN_SECRET_LEN = 16
REFUSAL_LOG_EVERY_S = 60.0  # the same peer refused for the same reason: one warning per minute
SECRET_ENV = "DYN_FLEET_SECRET"
SECRET_FILE_ENV = "DYN_FLEET_SECRET_FILE"
DIALER = "dialer"
LISTENER = "listener"


def starts_like_v1(first: bytes | bytearray) -> bool:
    """A connection's first bytes start a request-plane request (1.x's wire, ours too): a u16 path length (1..4096), then the path,
    which begins with the instance id in hex.  Only to name a refused peer: HTTP or garbage is not one."""
    if len(first) < 3:
        return False
    length = int.from_bytes(first[:2], "big")
    return 0 < length <= 4096 and chr(first[2]) in "0123456789abcdef"


def _no_handshake(first: bytes | bytearray) -> str:
    """Why a peer's first bytes are no handshake: a request is named as such (one line)."""
    return NO_HANDSHAKE_1X if starts_like_v1(first) else NO_HANDSHAKE


class FleetAuthError(Exception):
    """The peer did not prove it holds the fleet secret; the message says why, in a few words.

    ``reply``: our proof, when it was due in the same read that failed; it is still sent, so the peer
    learns that the secrets differ (its one line says so) rather than that we vanished."""

    def __init__(self, message: str, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reply = reply


def load_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The fleet secret from ``DYN_FLEET_SECRET`` or ``DYN_FLEET_SECRET_FILE`` (None: neither is set).

    A file group or others may read is refused: a secret anyone on the machine can read proves nothing.
    A secret shorter than 16 characters is refused: it could be guessed from one captured handshake.
    """
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV) or None
    path = env.get(SECRET_FILE_ENV) or None
    if value is not None and path is not None:
        raise RuntimeConfigError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    source = SECRET_ENV
    if path is not None:
        source = f"{SECRET_FILE_ENV} {path}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise RuntimeConfigError(f"{SECRET_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o077:
                raise RuntimeConfigError(f"{SECRET_FILE_ENV} {path} may be read by group or others (mode "
                                         f"{mode:04o}): chmod 600 {path}")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(65536)
        finally:
            os.close(fd)
        value = raw.decode("utf-8", "replace").strip()
    if value is None:
        return None
    value = value.strip()
    if len(value) < MIN_SECRET_LEN:
        raise RuntimeConfigError(f"{source}: the fleet secret is {len(value)} characters; use at least "
                                 f"{MIN_SECRET_LEN} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return value.encode("utf-8")


class FleetAuth:
    """The keys derived from one fleet secret; the secret itself is not kept."""

    __slots__ = ("_key", "_derive")

    def __init__(self, secret: bytes) -> None:
        master = hashlib.sha256(b"dynamo fleet secret\0" + secret).digest()
        self._key = hmac.new(master, b"tcp handshake", hashlib.sha256).digest()
        self._derive = hmac.new(master, b"derived keys", hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "FleetAuth(<secret>)"

    def derive(self, label: str) -> bytes:
        """32 bytes for ``label`` (a CURVE key, ...): the same on every process with the same secret."""
        return hmac.new(self._derive, label.encode(), hashlib.sha256).digest()

    def handshake(self, role: str, address: str) -> "Handshake":
        return Handshake(self._key, role, address)


def is_fleet_hello(data: bytes | bytearray) -> bool:
    """The first bytes a fleet-secret peer sends (for a process without the secret to say so)."""
    return bytes(data[:len(MAGIC)]) == MAGIC


class Handshake:
    """One side's state: send :attr:`hello` first, then :meth:`feed` it what the peer sends.

    No I/O here (the asyncio side is :class:`AuthGate`), so it is tested byte by byte.
    """

    __slots__ = ("_key", "role", "address", "nonce", "hello", "_buf", "_peer_nonce", "_expect", "done")

    def __init__(self, key: bytes, role: str, address: str, nonce: bytes | None = None) -> None:
        if role not in (DIALER, LISTENER):
            raise ValueError(f"role must be {DIALER!r} or {LISTENER!r}")
        self._key = key
        self.role = role
        self.address = address
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_LEN)
        self.hello = MAGIC + self.nonce
        self._buf = bytearray()
        self._peer_nonce: bytes | None = None
        self._expect = b""
        self.done = False

    @property
    def peer_hello(self) -> bool:
        """The peer's hello has arrived (it speaks the handshake)."""
        return self._peer_nonce is not None

    def _proof(self, role: str, listener_nonce: bytes, dialer_nonce: bytes) -> bytes:
        msg = b"".join((role.encode(), b"\0", self.address.encode(), b"\0", listener_nonce, dialer_nonce))
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """(bytes to send the peer, bytes after the handshake once :attr:`done`); raises FleetAuthError."""
        if self.done:
            return b"", data
        buf = self._buf
        buf += data
        out = b""
        if self._peer_nonce is None:
            if len(buf) < len(MAGIC):
                if bytes(buf) != MAGIC[:len(buf)]:
                    raise FleetAuthError(_no_handshake(buf))
                return b"", b""
            if not is_fleet_hello(buf):
                raise FleetAuthError(_no_handshake(buf))
            if len(buf) < HELLO_LEN:
                return b"", b""
            peer = bytes(buf[len(MAGIC):HELLO_LEN])
            if peer == self.nonce:
                raise FleetAuthError("it sent our own nonce back")
            del buf[:HELLO_LEN]
            self._peer_nonce = peer
            mine, theirs = (DIALER, LISTENER) if self.role == DIALER else (LISTENER, DIALER)
            ln, dn = (peer, self.nonce) if self.role == DIALER else (self.nonce, peer)
            out = self._proof(mine, ln, dn)
            self._expect = self._proof(theirs, ln, dn)
        if len(buf) < PROOF_LEN:
            return out, b""
        proof = bytes(buf[:PROOF_LEN])
        rest = bytes(buf[PROOF_LEN:])
        buf.clear()
        if not hmac.compare_digest(proof, self._expect):
            raise FleetAuthError("its proof does not match our fleet secret (another DYN_FLEET_SECRET)", out)
        self.done = True
        return out, rest


class RefusalLog:
    """One warning per peer host and reason a minute: a flood of failed handshakes is not a flood of lines."""

    def __init__(self, every_s: float = REFUSAL_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, ...], float] = {}

    def __call__(self, key: tuple[str, str], message: str) -> None:
        """``key``: (peer, reason); the plane (the message's words before its first colon) is part of it."""
        full = (*key, message.partition(":")[0])
        now = time.monotonic()
        last = self._last.get(full)
        if last is not None and now - last < self.every_s:
            log.debug("%s", message)
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[full] = now
        log.warning("%s", message)


refusals = RefusalLog()


def peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "?"


class AuthGate(asyncio.Protocol):
    """Runs the handshake on a fresh connection, then hands the transport to the plane's protocol
    (``inner``): its ``connection_made`` is called only once the peer has proved itself, so the plane's
    code never sees an unauthenticated byte. A dialer awaits :attr:`ready` (the inner protocol)."""

    def __init__(self, auth: FleetAuth, role: str, address: str, inner: asyncio.Protocol, what: str) -> None:
        self.hs = auth.handshake(role, address)
        self.inner = inner
        self.what = what  # "request plane", "response streams": for the log line
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[asyncio.Protocol] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._peer = peer_name(transport) if self.hs.role == LISTENER else self.hs.address
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:  # the proof must not wait for the hello's ACK (Nagle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT, self._timeout)
        transport.write(self.hs.hello)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        try:
            out, rest = self.hs.feed(data)
        except FleetAuthError as exc:
            if exc.reply:
                transport.write(exc.reply)
            self._refuse(str(exc))
            return
        if out:
            transport.write(out)
        if self.hs.done:
            self._cancel_timer()
            self.transport = None
            inner = self.inner
            transport.set_protocol(inner)
            inner.connection_made(transport)
            if not self.ready.done():
                self.ready.set_result(inner)
            if rest:
                inner.data_received(rest)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return  # refused already (or handed over: the inner protocol is told, not us)
        self.transport = None
        self._cancel_timer()
        if self.hs.role == DIALER:
            self._fail(f"{self.what}: {self._peer} closed the connection during the fleet-secret handshake "
                       "(no DYN_FLEET_SECRET there, or another one)", "closed")
        else:  # the peer gave up on us: no handshake of its own (no secret there), or it refused our proof
            why = ("it closed the connection after its hello (it refused our proof: another DYN_FLEET_SECRET?)"
                   if self.hs.peer_hello else "it closed the connection without the fleet-secret handshake (no "
                   "DYN_FLEET_SECRET there?)")
            refusals((self._peer.rpartition(":")[0], why), f"{self.what}: refused a connection from {self._peer}: {why}")

    def _timeout(self) -> None:
        self._timer = None
        self._refuse(f"no fleet-secret handshake within {HANDSHAKE_TIMEOUT:g}s")

    def _refuse(self, why: str) -> None:
        transport, self.transport = self.transport, None
        self._cancel_timer()
        if self.hs.role == DIALER:
            self._fail(f"{self.what}: {self._peer} failed the fleet-secret check: {why}", why)
        else:
            host = self._peer.rpartition(":")[0]
            refusals((host, why), f"{self.what}: refused a connection from {self._peer}: {why}")
        if transport is not None:
            transport.close()

    def _fail(self, message: str, why: str) -> None:
        refusals((self._peer, why), message)
        if not self.ready.done():
            self.ready.set_exception(FleetAuthError(message))
            self.ready.exception()  # retrieved: a dialer that gave up waiting is not an error

    def abandon(self) -> None:
        """We close the connection ourselves (the dialer gave up): no line blames the peer."""
        self.transport = None
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def handshake_streams(auth: FleetAuth, role: str, address: str, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """The handshake on an ``asyncio.start_server`` / ``open_connection`` stream pair (the KV transfer
    server's). Reads exactly the handshake's bytes, so the plane's first byte is still in ``reader``.
    Raises :class:`FleetAuthError` (the caller logs it and closes)."""
    hs = auth.handshake(role, address)
    try:
        async with asyncio.timeout(timeout):
            writer.write(hs.hello)
            proof, _ = hs.feed(await reader.readexactly(HELLO_LEN))
            writer.write(proof)
            await writer.drain()
            hs.feed(await reader.readexactly(PROOF_LEN))
    except FleetAuthError as exc:
        if exc.reply:
            writer.write(exc.reply)
        raise
    except asyncio.IncompleteReadError:
        raise FleetAuthError("it closed the connection during the fleet-secret handshake (no DYN_FLEET_SECRET "
                             "there, or another one)") from None
    except TimeoutError:
        raise FleetAuthError(f"no fleet-secret handshake within {timeout:g}s") from None


def guarded(auth: FleetAuth | None, address: Callable[[], str], factory: Callable[[], asyncio.Protocol],
            what: str) -> Callable[[], asyncio.Protocol]:
    """A listener's protocol factory: ``factory`` itself without a secret, else behind an :class:`AuthGate`
    (``address()``: what dialers dial, read when a connection arrives). Under TLS (:mod:`.tcp_tls`) the
    handshake runs inside the TLS session."""
    if auth is None:
        return factory
    return lambda: AuthGate(auth, LISTENER, address(), factory(), what)


P = TypeVar("P", bound=asyncio.Protocol)


async def _connect(loop: asyncio.AbstractEventLoop, factory: Callable[[], P], host: str, port: int,
                   address: str) -> tuple[asyncio.BaseTransport, P]:
    """A connection to ``host:port``, in TLS when this process dials with it (:mod:`.tcp_tls`); a failed
    handshake is a :class:`tcp_tls.TlsDialError` (an OSError: callers treat it as an unreachable peer) whose
    message says why in one line."""
    options = tcp_tls.settings().dial_options(host)
    if not options:
        return await loop.create_connection(factory, host, port)
    try:
        return await loop.create_connection(factory, host, port, **options)
    except (ssl.SSLError, ConnectionAbortedError, ConnectionResetError, TimeoutError) as exc:
        raise tcp_tls.TlsDialError(f"TLS handshake with {address} failed: {tcp_tls.handshake_reason(exc)}") from None


async def dial(auth: FleetAuth | None, address: str, host: str, port: int,
               factory: Callable[[], asyncio.Protocol], timeout: float, what: str) -> asyncio.Protocol:
    """Connect to ``host:port`` (``address`` as the listener advertised it) and return the protocol once
    the connection is usable: at once without a secret, else once the listener has proved itself.
    Raises OSError / TimeoutError (no connection) or :class:`FleetAuthError` (refused)."""
    loop = asyncio.get_running_loop()
    if auth is None:
        _, proto = await asyncio.wait_for(_connect(loop, factory, host, port, address), timeout)
        return proto

    async def connect() -> asyncio.Protocol:
        transport, gate = await _connect(loop, lambda: AuthGate(auth, DIALER, address, factory(), what),
                                         host, port, address)
        try:
            return await gate.ready
        except BaseException:  # refused, or the caller's timeout: the connection goes either way
            gate.abandon()
            transport.close()
            raise

    return await asyncio.wait_for(connect(), timeout)
