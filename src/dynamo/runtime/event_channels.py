"""The event plane (:class:`~dynamo.runtime.event_plane.EventPlane`) over ZMQ or NATS, in Dynamo 1.x's form:
our processes publish and follow events this way among themselves as with 1.6.1's.

* :meth:`EventChannels.publisher`: one publisher per scope (an endpoint) and topic.  On ZMQ it binds its own
  PUB socket (where our planes listen: :func:`~dynamo.runtime.tcp.listen_hosts`) and sends 1.x's 4-frame
  messages; on NATS it publishes the bare envelope on the scope's subject (:mod:`.v1_event_wire`).  Either
  way its ``EventChannel`` record is written under this process's lease, so it goes when the process does.
* :meth:`EventChannels.subscribe`: watch the ``v1/event_channels`` records of one scope and topic and follow
  every publisher they name (connect a SUB socket to each ZMQ one, subscribe to the subject for NATS
  ones), handing each envelope to a callback on the event loop.

A process does not hear its own events: a subscription skips the records of this plane's own publishers
and drops NATS's echo of them.  Its consumers already know what they published (a KV router its own
bookings); hearing them back cost a frontend at 64 streams about 4 % of its samples (py-spy: the SUB
socket's futures, decoding, then the router ignoring its own router id).  For the same reason a ZMQ
publisher sends through a blocking twin of its socket with ``NOBLOCK``: a PUB socket never waits (past its
high-water mark it drops), so the asyncio socket's future and callback per event bought nothing.

What may be lost, as an event plane allows: events published before a subscriber's connection to the
publisher has finished its handshake, and while a connection is down.  :attr:`EventChannels.reconnects`
counts every finished ZMQ handshake and every NATS reconnect: the signal on which consumers that need
every event (the KV router) ask each worker for its state again (its recovery endpoint), so a subscriber
that joins after a publisher, or sees one come and go, catches up.

Which transport a publisher uses follows this process's event plane (``--event-plane``, 1.x's
``DYN_EVENT_PLANE``); a subscriber follows each publisher where its record says, so processes on different
planes still hear each other, except a NATS publisher and a process without NATS (plane_choice.py warns).  With a fleet secret every ZMQ socket is
CURVE (:mod:`.zmq_curve`): our processes hear each other, a 1.6.1 router (no authentication on its event
plane) hears nothing.

Why pyzmq rather than our own framing over TCP: fan-out to many subscribers, publisher-side filtering,
reconnection and high-water marks are what ZMQ is, and 1.x and vLLM already speak it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .event_plane import EnvelopeHandler
from .fleet_auth import FleetAuth
from .kv_store import KeyValueStore
from .v1_event_wire import (
    EVENT_CHANNELS,
    EVENT_SOURCES,
    EndpointScope,
    Envelope,
    WireError,
    decode_envelope,
    decode_zmq_frames,
    encode_envelope,
    nats_channel_record,
    new_publisher_id,
    parse_channel,
    source_record,
    zmq_channel_record,
    zmq_frames,
)
from .zmq_curve import FAILURES, CurveKeys, say_failure, start_zap, watch_failures

log = logging.getLogger(__name__)

SEND_HWM = 100_000  # as 1.6.1's kv-events subscribers ask (rcvhwm 100000); a stalled subscriber's queue
_warned: dict[str, float] = {}


def _warn_once_a_minute(key: str, msg: str, *args: Any) -> None:
    now = time.monotonic()
    if now - _warned.get(key, -120.0) >= 60.0:
        _warned[key] = now
        log.warning(msg, *args)


class SubPeers:
    """The publishers a SUB socket is connected to, by the ``EventChannel`` record that named each.  A record
    may come back with another address (a publisher restarted) and two records may name one address, so an
    address is disconnected only once no record names it.  ``sock`` is set once the socket exists."""

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


class Publisher:
    """One event stream of this process: ``publish(payload)`` wraps it in 1.x's envelope and sends it."""

    def __init__(self, plane: "EventChannels", scope: EndpointScope, topic: str, publisher_id: int,
                 sock: Any = None, address: str = "") -> None:
        self.plane = plane
        self.scope = scope
        self.topic = topic
        self.publisher_id = publisher_id
        self.sequence = 0
        self._sock = sock  # the PUB socket (ZMQ), None on NATS
        self.transport = "zmq" if sock is not None else "nats"
        # the same socket, blocking: sending with NOBLOCK returns at once and makes no future
        self._twin = zmq.Socket.shadow(sock.underlying) if sock is not None else None
        self.address = address  # where it is bound (tcp://host:port), "" on NATS
        self._subject = scope.subject(topic)

    def publish(self, payload: bytes) -> Any:
        """Send one event (the topic's MessagePack payload); returns what to await for it to leave, or None."""
        if self.plane.closed:
            return None
        seq = self.sequence
        self.sequence += 1
        if self._twin is not None:
            try:
                self._twin.send_multipart(zmq_frames(self.publisher_id, seq, self.topic, payload), zmq.NOBLOCK,
                                          copy=False)
            except zmq.Again:  # (a PUB socket drops past its high-water mark rather than say so)
                pass
            return None
        nats = self.plane.nats
        if nats is None or self.plane.kind != "nats":  # (a ZMQ publisher closed)
            return None
        return nats.publish(self._subject, encode_envelope(self.publisher_id, seq, self.topic, payload))

    def record_key(self) -> str:
        return self.scope.key(EVENT_CHANNELS, self.topic, self.publisher_id)

    def close(self) -> None:
        self._twin = None  # (a closed ZMQ publisher sends nothing: publish() finds no NATS plane either)
        if self._sock is not None:
            if self.plane.curve is not None:
                self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None


class Subscription:
    """The publishers of one scope and topic, followed (see :meth:`EventChannels.subscribe`)."""

    def __init__(self, plane: "EventChannels", scope: EndpointScope, topic: str, handler: EnvelopeHandler) -> None:
        self.plane = plane
        self.scope = scope
        self.topic = topic
        self.handler = handler
        self.peers = SubPeers()  # record key -> ZMQ address
        self._sock: Any = None
        self._nats_sub: Any = None
        self._watch: Any = None
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def on_nats(self) -> bool:
        """Subscribed on NATS (a publisher of this scope and topic said it publishes there)."""
        return self._nats_sub is not None

    async def start(self) -> "Subscription":
        plane = self.plane
        sock = plane.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if plane.curve is not None:
            plane.curve.client(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILURES)
        self._sock = self.peers.sock = sock
        self._watch = await plane.discovery.watch_prefix(self.scope.key_prefix(EVENT_CHANNELS, self.topic)).start()
        for kv in self._watch.initial:
            await self._add(kv.key, kv.value)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive(), name=f"v1-events-{self.topic}"),
                       loop.create_task(self._follow(), name=f"v1-channels-{self.topic}"),
                       loop.create_task(self._count_handshakes(monitor), name=f"v1-monitor-{self.topic}")]
        return self

    async def _add(self, key: str, value: bytes) -> None:
        try:
            channel = parse_channel(value)
        except WireError as e:
            _warn_once_a_minute(key, "ignoring event channel %s: %s", key, e)
            return
        if channel.topic != self.topic or channel.publisher_id in self.plane.own_ids:
            return
        if channel.kind == "nats":
            await self._subscribe_nats()
            return
        if self.peers.follow(key, channel.address):
            log.debug("events: following %s %s at %s", self.scope.subject_prefix, self.topic, channel.address)

    async def _subscribe_nats(self) -> None:
        nats = self.plane.nats
        if self._nats_sub is not None:
            return
        if nats is None:
            _warn_once_a_minute(f"nats:{self.topic}", "events: %s publishes %s on NATS and this process has "
                                "no NATS (set NATS_SERVER)", self.scope.subject_prefix, self.topic)
            return

        async def on_message(msg: Any) -> None:
            try:
                env = decode_envelope(msg.data)
            except WireError as e:
                _warn_once_a_minute(msg.subject, "events: undecodable message on %s: %s", msg.subject, e)
                return
            if env.publisher_id not in own:  # NATS echoes a connection's own messages
                self._deliver(env)

        own = self.plane.own_ids

        self._nats_sub = await nats.subscribe(self.scope.subject(self.topic), cb=on_message)

    async def _follow(self) -> None:
        async for ev in self._watch:
            if ev.initial:
                continue
            if ev.kind == "put":
                await self._add(ev.key, ev.value)
            else:
                self.peers.drop(ev.key)

    async def _receive(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=True)
            try:
                env = decode_zmq_frames(frames)
            except WireError as e:
                _warn_once_a_minute(f"zmq:{self.topic}", "events: undecodable %s message: %s", self.topic, e)
                continue
            self._deliver(env)

    def _deliver(self, env: Envelope) -> None:
        if env.topic != self.topic:
            return
        try:
            self.handler(env)
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the stream
            _warn_once_a_minute(f"handler:{self.topic}", "events: %s handler failed: %s", self.topic, exc)

    async def _count_handshakes(self, monitor: Any) -> None:
        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.plane.handshakes += 1
            else:
                say_failure(msg, "subscriber", self.plane.curve is not None)

    async def unsubscribe(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._watch is not None:
            await self._watch.close()
            self._watch = None
        if self._nats_sub is not None:
            try:
                await self._nats_sub.unsubscribe()
            except Exception:  # the connection may be closed already
                pass
            self._nats_sub = None
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self in self.plane.subscriptions:
            self.plane.subscriptions.remove(self)


class EventChannels:
    """Publishers and subscriptions in 1.x's form, over ZMQ or NATS (``kind``), found through ``discovery``;
    ``auth``: the fleet secret, which makes every ZMQ socket CURVE (:mod:`.zmq_curve`)."""

    def __init__(self, discovery: KeyValueStore, kind: str, *, nats: Any = None, host: str | None = None,
                 advertise: str = "127.0.0.1", auth: FleetAuth | None = None) -> None:
        if kind not in ("zmq", "nats"):
            raise ValueError(f"event plane kind must be zmq or nats, not {kind!r}")
        self.discovery = discovery
        self.kind = kind
        self.nats = nats
        self.host = host  # where ZMQ publishers bind (None: every interface)
        self.advertise = advertise
        # None: no secret, plain ZMQ; raises (one line) when this libzmq cannot meet a secret
        self.curve = CurveKeys(auth) if auth is not None and kind == "zmq" else None
        self.ctx = zmq.asyncio.Context()
        self.publishers: list[Publisher] = []
        # this process's publishers' ids: its subscriptions skip them (it knows what it said)
        self.own_ids: set[int] = set()
        self.subscriptions: list[Subscription] = []
        self.handshakes = 0
        self.closed = False
        self._zap: Any = None
        self._tasks: list[asyncio.Task[None]] = []  # the ZAP handler, the publishers' failure monitors

    @property
    def reconnects(self) -> int:
        """Handshakes finished with publishers (new or back) plus NATS reconnects: events may have been
        missed before them."""
        stats = getattr(self.nats, "stats", None) if self.nats is not None else None
        return self.handshakes + (int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0)

    async def publisher(self, scope: EndpointScope, topic: str) -> Publisher:
        """A new publisher of ``topic`` in ``scope``, advertised in discovery under this process's lease."""
        if self.closed:
            raise RuntimeError("the event plane is closed")
        publisher_id = new_publisher_id()
        if self.kind == "zmq":
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                if self._zap is None:
                    self._zap, task = start_zap(self.ctx, self.curve)
                    self._tasks.append(task)
                self.curve.serve(sock)
                self._tasks.append(asyncio.get_running_loop().create_task(
                    watch_failures(sock.get_monitor_socket(FAILURES), "publisher", True), name="zmq-publisher-monitor"))
            port = sock.bind_to_random_port("tcp://*" if not self.host else f"tcp://{self.host}")
            host = self.advertise
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            pub = Publisher(self, scope, topic, publisher_id, sock, address)
            log.info("events: publishing %s of %s on %s", topic, scope.subject_prefix, address)
            record = zmq_channel_record(scope, topic, publisher_id, address)
        else:
            pub = Publisher(self, scope, topic, publisher_id)
            record = nats_channel_record(scope, topic, publisher_id)
        self.own_ids.add(publisher_id)  # before the record exists, so no subscription follows it
        await self.discovery.put(pub.record_key(), record, lease=True)
        self.publishers.append(pub)
        return pub

    async def register_source(self, pub: Publisher, metadata: dict[str, Any]) -> None:
        """Write ``pub``'s ``EventSource`` record (what a consumer needs to recover its stream)."""
        await self.discovery.put(pub.scope.key(EVENT_SOURCES, pub.topic, pub.publisher_id),
                                 source_record(pub.scope, pub.topic, pub.publisher_id, metadata), lease=True)

    async def subscribe(self, scope: EndpointScope, topic: str, handler: EnvelopeHandler) -> Subscription:
        """Follow every publisher of ``topic`` in ``scope``, now and as they come and go; ``handler`` gets
        each envelope on the event loop (keep it short)."""
        if self.closed:
            raise RuntimeError("the event plane is closed")
        sub = await Subscription(self, scope, topic, handler).start()
        self.subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        self.closed = True
        for sub in list(self.subscriptions):
            await sub.unsubscribe()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for pub in self.publishers:  # their records go with the lease
            pub.close()
        self.publishers.clear()
        self.ctx.destroy(linger=0)
