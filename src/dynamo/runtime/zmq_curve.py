"""The fleet secret on the event plane's ZMQ sockets: CURVE keys, the ZAP handler, handshake failures.

With a fleet secret (``DYN_FLEET_SECRET``, :mod:`.fleet_auth`) every event-plane connection is ZMQ CURVE:
encrypted, and authenticated both ways, with two keypairs derived from the secret (the same on every
process, so nothing more needs distributing and nothing goes into discovery).  A publisher is the CURVE
server: a subscriber must know its public key (derived from the secret, never sent or stored) to complete
the handshake, and the publisher's ZAP handler admits only the subscriber key derived from the same
secret, so the subscriber proves it holds that key's secret half too.  A subscriber with another secret,
or none (a Dynamo 1.6.1 router among them: 1.x has no authentication on its event plane), gets no event;
each side logs one line per peer a minute.

Why CURVE rather than our TCP handshake: ZMQ owns the sockets (reconnects included), so authentication has
to be ZMQ's own mechanism, and CURVE also encrypts the KV events (block hashes of users' prompts) on the
way.  libzmq without CURVE (built without libsodium or its own tweetnacl) cannot meet a fleet secret: the
process refuses to start rather than publish in the clear.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Mapping

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .errors import RuntimeConfigError
from .fleet_auth import FleetAuth, refusals

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's handler about each CURVE peer
ZAP_DOMAIN = b"dynamo-events"
FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
FAILED: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
                          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed (authentication)"}


class CurveKeys:
    """The fleet's two CURVE keypairs (z85), derived from its secret: the publishers' and the subscribers'."""

    def __init__(self, auth: FleetAuth) -> None:
        if not zmq.has("curve"):
            raise RuntimeConfigError("DYN_FLEET_SECRET needs ZMQ CURVE for the event plane and this libzmq has "
                                     f"none (libzmq {zmq.zmq_version()}); use a pyzmq wheel, or --event-plane nats")
        self.server_secret = z85.encode(auth.derive("zmq curve publisher"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(auth.derive("zmq curve subscriber"))
        self.client_public = zmq.curve_public(self.client_secret)
        self.client_public_raw = z85.decode(self.client_public)

    def serve(self, sock: Any) -> None:
        """Make a PUB socket a CURVE server whose subscribers the context's ZAP handler checks."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN

    def client(self, sock: Any) -> None:
        """Make a SUB socket a CURVE client with the fleet's subscriber key."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


def start_zap(ctx: zmq.asyncio.Context, curve: CurveKeys) -> tuple[Any, "asyncio.Task[None]"]:
    """The context's ZAP handler (its socket and the task answering it): admits the fleet's subscriber key,
    refuses any other."""
    zap = ctx.socket(zmq.REP)
    zap.setsockopt(zmq.LINGER, 0)
    zap.bind(ZAP_ENDPOINT)
    return zap, asyncio.get_running_loop().create_task(_answer_zap(zap, curve), name="zmq-zap")


async def _answer_zap(zap: Any, curve: CurveKeys) -> None:
    while True:
        frames = await zap.recv_multipart()
        if len(frames) < 6:  # not a ZAP request; REP must still answer it
            await zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""])
            continue
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        key = frames[6] if len(frames) > 6 else b""
        ok = mechanism == b"CURVE" and hmac.compare_digest(key, curve.client_public_raw)
        if not ok:
            peer = address.decode("utf-8", "replace")
            refusals((peer, "zap"), f"events: refused a subscriber from {peer}: its key is not the fleet's "
                                    "(another DYN_FLEET_SECRET, or none)")
        await zap.send_multipart([version, request_id, b"200" if ok else b"400", b"OK" if ok else b"not the fleet",
                                  b"fleet" if ok else b"", b""])


def say_failure(msg: Mapping[str, Any], side: str, secret: bool) -> None:
    """One line (a minute, per peer) for a failed handshake of a monitored socket; ``side``: subscriber or
    publisher, ``secret``: whether this process has a fleet secret."""
    why = FAILED.get(msg["event"])
    if why is None:
        return
    endpoint = msg.get("endpoint", b"")
    where = endpoint.decode("utf-8", "replace") if isinstance(endpoint, bytes) else str(endpoint)
    cause = "another DYN_FLEET_SECRET, or none" if secret else \
        "it has a fleet secret and this process has none (set DYN_FLEET_SECRET)"
    if side == "subscriber":
        refusals((where, f"subscriber {why}"), f"events: cannot subscribe to {where}: {why}: {cause}")
    else:
        refusals((where, f"publisher {why}"), f"events: refused a subscriber on {where}: {why}: {cause}")


async def watch_failures(monitor: Any, side: str, secret: bool) -> None:
    """Say each failed handshake a PUB socket's monitor reports (see :func:`say_failure`)."""
    while True:
        say_failure(parse_monitor_message(await monitor.recv_multipart()), side, secret)
