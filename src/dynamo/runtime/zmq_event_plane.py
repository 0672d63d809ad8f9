"""The event plane over ZMQ pub/sub (an :class:`~dynamo.runtime.event_plane.EventPlane` with no broker).

Each process binds one PUB socket when it connects (an ephemeral port, on loopback on one machine;
``DYN_TCP_RPC_HOST`` is where it binds and the address it advertises: :func:`~dynamo.runtime.tcp.listen_hosts`) and writes ``tcp://host:port`` under ``event_plane/zmq/<instance>`` in discovery,
bound to its lease; it is gone when the process is. A process that subscribes opens one SUB socket,
watches that prefix, and connects to every publisher as it appears and disconnects as it goes, its own
included (as NATS delivers a process its own messages). ZMQ filters by topic prefix on the publisher's
side; an event is sent as two frames, the subject followed by a NUL byte (so ``kv_events`` does not
match ``kv_events_x``) and the payload.

What may be lost, as the event plane allows: events published before a subscriber's connection to the
publisher has finished its handshake, and while a connection is down. Every finished handshake counts
in :attr:`ZmqEventPlane.reconnects`, the signal on which consumers that need every event (the KV
router) ask each worker for a snapshot (its ``kv_state``), so a subscriber that joins after the
publisher, or sees a publisher come and go, catches up as it does after a NATS reconnect.

Why pyzmq rather than our own framing over TCP: fan-out to many subscribers, publisher-side filtering,
reconnection and high-water marks are what ZMQ is, and vLLM's KV events already use it
(:mod:`dynamo.kv.zmq_events`).

With a fleet secret (``DYN_FLEET_SECRET``, :mod:`.fleet_auth`) every connection is ZMQ CURVE: encrypted,
and authenticated both ways, with two keypairs derived from the secret (the same on every process, so
nothing more needs distributing and nothing goes into discovery). The publisher is the CURVE server: a
subscriber must know its public key (derived from the secret, never sent or stored) to complete the
handshake, and this process's ZAP handler admits only the subscriber key derived from the same secret, so
the subscriber proves it holds that key's secret half too. A subscriber with another secret, or none, gets
no event; each side logs one line per peer a minute. Why CURVE rather than our TCP handshake: ZMQ owns
the sockets (reconnects included), so authentication has to be ZMQ's own mechanism, and CURVE also
encrypts the KV events (block hashes of users' prompts) on the way. libzmq without CURVE (built without
libsodium or its own tweetnacl) cannot meet a fleet secret: the process refuses to start rather than
publish in the clear.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import orjson
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .errors import RuntimeConfigError
from .event_plane import EventHandler
from .fleet_auth import FleetAuth, refusals
from .kv_store import KeyValueStore
from .names import lease_hex
from .tcp import advertise_host

log = logging.getLogger(__name__)

PUBLISHERS_PREFIX = "event_plane/zmq/"
SEND_HWM = 100_000  # events queued per subscriber before ZMQ drops them (a stalled subscriber)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's handler about each CURVE peer
_FAILED: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake failed (authentication)"}
_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


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


def _topic(subject: str) -> bytes:
    return subject.encode() + b"\0"


class SubPeers:
    """The publishers a SUB socket is connected to, by the discovery record that named each (ours under
    ``event_plane/zmq/``, 1.x's ``EventChannel`` records).  A record may come back with another address (a
    publisher restarted) and two records may name one address, so an address is disconnected only once no
    record names it.  ``sock`` is set once the socket exists."""

    def __init__(self) -> None:
        self.sock: Any = None
        self.addresses: dict[str, str] = {}

    def follow(self, key: str, address: str) -> bool:
        """Connect to ``address`` for record ``key``; False when it already was."""
        old = self.addresses.get(key)
        if old == address:
            return False
        if old is not None:
            self.drop(key)
        self.addresses[key] = address
        self.sock.connect(address)
        return True

    def drop(self, key: str) -> None:
        address = self.addresses.pop(key, None)
        if address is not None and address not in self.addresses.values() and self.sock is not None:
            try:
                self.sock.disconnect(address)
            except zmq.ZMQError:
                pass


class ZmqSubscription:
    def __init__(self, plane: "ZmqEventPlane", subject: str, handler: EventHandler) -> None:
        self.plane = plane
        self.subject = subject
        self.handler = handler

    async def unsubscribe(self) -> None:
        self.plane.remove(self)


class ZmqEventPlane:
    def __init__(self, discovery: KeyValueStore, host: str | None = None, advertise: str | None = None,
                 auth: FleetAuth | None = None) -> None:
        self.discovery = discovery
        self.curve = CurveKeys(auth) if auth is not None else None  # None: no secret, plain ZMQ as before
        self.host = host  # where the publisher binds (None: every interface)
        self.advertise = advertise or advertise_host(host)  # the address written into discovery
        self.address = ""
        self.port = 0  # the publisher's, once bound
        self._ctx = zmq.asyncio.Context()
        self._pub: Any = None
        self._sub: Any = None
        self._handlers: dict[bytes, list[ZmqSubscription]] = {}
        self._publishers = SubPeers()  # discovery key -> address connected to
        self._tasks: list[asyncio.Task] = []
        self._watch: Any = None
        self._reconnects = 0
        self._zap: Any = None
        self._lock = asyncio.Lock()
        self._closed = False

    # ------------------------------------------------------------------ publishing

    async def start_publisher(self, instance_id: int) -> None:
        """Bind the PUB socket and say where it is in discovery (under this process's lease)."""
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        curve = self.curve
        if curve is not None:
            self._start_zap(curve)
            sock.curve_secretkey = curve.server_secret
            sock.curve_publickey = curve.server_public
            sock.curve_server = True
            sock.zap_domain = b"dynamo-events"
            monitor = sock.get_monitor_socket(_FAILURES)
            self._tasks.append(asyncio.get_running_loop().create_task(self._monitor(monitor, "publisher"),
                                                                      name="zmq-publisher-monitor"))
        port = sock.bind_to_random_port("tcp://*" if not self.host else f"tcp://{self.host}")
        self.port = port
        host = self.advertise
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._pub = sock
        await self.discovery.put(PUBLISHERS_PREFIX + lease_hex(instance_id),
                                 orjson.dumps({"address": self.address, "instance_id": instance_id}), lease=True)
        log.debug("event plane: publishing on %s", self.address)

    async def publish(self, subject: str, payload: bytes) -> None:
        if self._pub is None or self._closed:
            raise RuntimeError("the ZMQ event plane has no publisher (closed, or a static runtime)")
        await self._pub.send_multipart((_topic(subject), payload), copy=False)

    # ------------------------------------------------------------------ subscribing

    async def subscribe(self, subject: str, handler: EventHandler) -> ZmqSubscription:
        await self._start_subscriber()
        sub = ZmqSubscription(self, subject, handler)
        topic = _topic(subject)
        subs = self._handlers.setdefault(topic, [])
        if not subs:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        subs.append(sub)
        return sub

    def remove(self, sub: ZmqSubscription) -> None:
        topic = _topic(sub.subject)
        subs = self._handlers.get(topic)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._handlers[topic]
                if self._sub is not None and not self._closed:
                    self._sub.setsockopt(zmq.UNSUBSCRIBE, topic)

    @property
    def reconnects(self) -> int:
        """Handshakes finished with publishers (new ones and reconnected ones): events may have been missed."""
        return self._reconnects

    async def _start_subscriber(self) -> None:
        async with self._lock:
            if self._sub is not None:
                return
            if self._closed:
                raise RuntimeError("the ZMQ event plane is closed")
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            curve = self.curve
            if curve is not None:
                sock.curve_serverkey = curve.server_public
                sock.curve_publickey = curve.client_public
                sock.curve_secretkey = curve.client_secret
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILURES)
            self._sub = self._publishers.sock = sock
            self._watch = await self.discovery.watch_prefix(PUBLISHERS_PREFIX).start()
            for kv in self._watch.initial:
                self._connect(kv.key, kv.value)
            loop = asyncio.get_running_loop()
            self._tasks += [loop.create_task(self._receive(), name="zmq-events"),
                            loop.create_task(self._follow(), name="zmq-publishers"),
                            loop.create_task(self._monitor(monitor, "subscriber"), name="zmq-monitor")]

    def _connect(self, key: str, value: bytes) -> None:
        try:
            address = str(orjson.loads(value)["address"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            log.warning("ignoring invalid event publisher record %s: %s", key, exc)
            return
        if self._publishers.follow(key, address):
            log.debug("event plane: subscribed to %s", address)

    def _disconnect(self, key: str) -> None:
        self._publishers.drop(key)

    async def _follow(self) -> None:
        async for ev in self._watch:
            if ev.initial:
                continue
            if ev.kind == "put":
                self._connect(ev.key, ev.value)
            else:
                self._disconnect(ev.key)

    async def _monitor(self, monitor: Any, side: str) -> None:
        """Count the subscriber's handshakes (each one is a publisher whose earlier events this process may
        lack) and say when one failed: a peer with another fleet secret, or none where one is needed."""
        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            event = msg["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if side == "subscriber":
                    self._reconnects += 1
                continue
            why = _FAILED.get(event)
            if why is None:
                continue
            endpoint = msg.get("endpoint", b"")
            where = endpoint.decode("utf-8", "replace") if isinstance(endpoint, bytes) else str(endpoint)
            secret = "another DYN_FLEET_SECRET, or none" if self.curve is not None else \
                "it has a fleet secret and this process has none (set DYN_FLEET_SECRET)"
            if side == "subscriber":
                refusals((where, f"subscriber {why}"), f"events: cannot subscribe to {where}: {why}: {secret}")
            else:
                refusals((where, f"publisher {why}"), f"events: refused a subscriber on {where}: {why}: {secret}")

    def _start_zap(self, curve: CurveKeys) -> None:
        """This context's ZAP handler: admits the fleet's subscriber key, refuses any other."""
        zap = self._ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        self._zap = zap
        self._tasks.append(asyncio.get_running_loop().create_task(self._answer_zap(zap, curve), name="zmq-zap"))

    async def _answer_zap(self, zap: Any, curve: CurveKeys) -> None:
        while True:
            frames = await zap.recv_multipart()
            if len(frames) < 6:  # not a ZAP request; REP must still answer it
                await zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request",
                                          b"", b""])
                continue
            version, request_id, _domain, address, _identity, mechanism = frames[:6]
            key = frames[6] if len(frames) > 6 else b""
            ok = mechanism == b"CURVE" and hmac.compare_digest(key, curve.client_public_raw)
            if not ok:
                peer = address.decode("utf-8", "replace")
                refusals((peer, "zap"), f"events: refused a subscriber from {peer}: its key is not the fleet's "
                                        "(another DYN_FLEET_SECRET)")
            await zap.send_multipart([version, request_id, b"200" if ok else b"400", b"OK" if ok else b"not the fleet",
                                      b"fleet" if ok else b"", b""])

    async def _receive(self) -> None:
        sock = self._sub
        handlers = self._handlers
        while True:
            topic, payload = await sock.recv_multipart()
            subject = topic[:-1].decode()
            for sub in list(handlers.get(topic, ())):
                try:
                    await sub.handler(subject, payload)
                except Exception as exc:  # noqa: BLE001 - one bad handler must not stop the others
                    log.warning("event handler for %s failed: %s", subject, exc)

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._watch is not None:
            await self._watch.close()
            self._watch = None
        if self._sub is not None:
            self._sub.disable_monitor()
        if self._pub is not None and self.curve is not None:
            self._pub.disable_monitor()
        self._ctx.destroy(linger=0)
        self._pub = self._sub = None
