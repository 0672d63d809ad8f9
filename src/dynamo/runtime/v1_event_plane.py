"""Dynamo 1.x's event plane, beside ours: publish and follow event streams the way 1.6.1's processes do.

Our own event plane (:mod:`.zmq_event_plane`, :mod:`.nats_event_plane`) stays as it is: one PUB socket per
process, our subjects, JSON.  A 1.x process finds publishers by their ``v1/event_channels`` records and
reads envelopes (:mod:`.v1_event_wire`), so a process of ours that is to be heard by 1.x routers, or to
hear 1.x workers, also speaks this:

* :meth:`V1EventPlane.publisher`: one publisher per scope and topic.  On ZMQ it binds its own PUB socket
  (where our planes listen: :func:`~dynamo.runtime.tcp.listen_hosts`) and sends 4-frame messages; on NATS it
  publishes the bare envelope on the scope's subject.  Either way its ``EventChannel`` record is written
  under this process's lease, so it goes when the process does.
* :meth:`V1EventPlane.subscribe`: watch the records of one scope and topic and follow every publisher they
  name (connect a SUB socket to each ZMQ one, subscribe to the subject for NATS ones), handing each
  envelope to a callback on the event loop.  Every finished ZMQ handshake counts in
  :attr:`V1EventPlane.reconnects`, the signal on which a KV router asks for the workers' state again (as
  for our own plane).

Which transport a publisher uses follows this process's event plane (``--event-plane``): a 1.x fleet's
processes must agree on it, as 1.x's ``DYN_EVENT_PLANE`` says.  No fleet secret here: 1.x has no
authentication on its event plane, so the runtime does not open this one when ``DYN_FLEET_SECRET`` is set
(:meth:`~dynamo.runtime.distributed.DistributedRuntime.v1_event_plane`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

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
from .zmq_event_plane import SubPeers

log = logging.getLogger(__name__)

SEND_HWM = 100_000  # as 1.6.1's kv-events subscribers ask (rcvhwm 100000)
EnvelopeHandler = Callable[[Envelope], None]
_warned: dict[str, float] = {}


def _warn_once_a_minute(key: str, msg: str, *args: Any) -> None:
    now = time.monotonic()
    if now - _warned.get(key, -120.0) >= 60.0:
        _warned[key] = now
        log.warning(msg, *args)


class V1Publisher:
    """One event stream of this process in 1.x's form: ``publish(payload)`` wraps and sends it."""

    def __init__(self, plane: "V1EventPlane", scope: EndpointScope, topic: str, publisher_id: int,
                 sock: Any = None) -> None:
        self.plane = plane
        self.scope = scope
        self.topic = topic
        self.publisher_id = publisher_id
        self.sequence = 0
        self._sock = sock  # the PUB socket (ZMQ), None on NATS
        self._subject = scope.subject(topic)

    def publish(self, payload: bytes) -> Any:
        """Send one event (the topic's MessagePack payload); returns what to await for it to leave, or None."""
        seq = self.sequence
        self.sequence += 1
        if self._sock is not None:
            return self._sock.send_multipart(zmq_frames(self.publisher_id, seq, self.topic, payload), copy=False)
        nats = self.plane.nats
        if nats is None or self.plane.closed:
            return None
        return nats.publish(self._subject, encode_envelope(self.publisher_id, seq, self.topic, payload))

    def record_key(self) -> str:
        return self.scope.key(EVENT_CHANNELS, self.topic, self.publisher_id)


class V1Subscription:
    """The publishers of one scope and topic, followed (see :meth:`V1EventPlane.subscribe`)."""

    def __init__(self, plane: "V1EventPlane", scope: EndpointScope, topic: str, handler: EnvelopeHandler) -> None:
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

    async def start(self) -> "V1Subscription":
        plane = self.plane
        sock = plane.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
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
            _warn_once_a_minute(key, "ignoring 1.x event channel %s: %s", key, e)
            return
        if channel.topic != self.topic:
            return
        if channel.kind == "nats":
            await self._subscribe_nats()
            return
        if self.peers.follow(key, channel.address):
            log.debug("1.x events: following %s %s at %s", self.scope.subject_prefix, self.topic, channel.address)

    async def _subscribe_nats(self) -> None:
        nats = self.plane.nats
        if self._nats_sub is not None:
            return
        if nats is None:
            _warn_once_a_minute(f"nats:{self.topic}", "1.x events: %s publishes %s on NATS and this process has "
                                "no NATS (set NATS_SERVER)", self.scope.subject_prefix, self.topic)
            return

        async def on_message(msg: Any) -> None:
            try:
                env = decode_envelope(msg.data)
            except WireError as e:
                _warn_once_a_minute(msg.subject, "1.x events: undecodable message on %s: %s", msg.subject, e)
                return
            self._deliver(env)

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
                _warn_once_a_minute(f"zmq:{self.topic}", "1.x events: undecodable %s message: %s", self.topic, e)
                continue
            self._deliver(env)

    def _deliver(self, env: Envelope) -> None:
        if env.topic != self.topic:
            return
        try:
            self.handler(env)
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the stream
            _warn_once_a_minute(f"handler:{self.topic}", "1.x events: %s handler failed: %s", self.topic, exc)

    async def _count_handshakes(self, monitor: Any) -> None:
        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.plane.handshakes += 1

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


class V1EventPlane:
    """Publishers and subscriptions in 1.x's form, over ZMQ or NATS (``kind``), found through ``discovery``."""

    def __init__(self, discovery: KeyValueStore, kind: str, *, nats: Any = None, host: str | None = None,
                 advertise: str = "127.0.0.1") -> None:
        if kind not in ("zmq", "nats"):
            raise ValueError(f"1.x event plane kind must be zmq or nats, not {kind!r}")
        self.discovery = discovery
        self.kind = kind
        self.nats = nats
        self.host = host  # where ZMQ publishers bind (None: every interface)
        self.advertise = advertise
        self.ctx = zmq.asyncio.Context()
        self.publishers: list[V1Publisher] = []
        self.subscriptions: list[V1Subscription] = []
        self.handshakes = 0
        self.closed = False

    @property
    def reconnects(self) -> int:
        """Handshakes finished with 1.x publishers (new or back): events may have been missed before them."""
        return self.handshakes

    async def publisher(self, scope: EndpointScope, topic: str) -> V1Publisher:
        """A new publisher of ``topic`` in ``scope``, advertised in discovery under this process's lease."""
        if self.closed:
            raise RuntimeError("the 1.x event plane is closed")
        publisher_id = new_publisher_id()
        if self.kind == "zmq":
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://*" if not self.host else f"tcp://{self.host}")
            host = self.advertise
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            pub = V1Publisher(self, scope, topic, publisher_id, sock)
            record = zmq_channel_record(scope, topic, publisher_id, address)
        else:
            pub = V1Publisher(self, scope, topic, publisher_id)
            record = nats_channel_record(scope, topic, publisher_id)
        await self.discovery.put(pub.record_key(), record, lease=True)
        self.publishers.append(pub)
        return pub

    async def register_source(self, pub: V1Publisher, metadata: dict[str, Any]) -> None:
        """Write ``pub``'s ``EventSource`` record (what a consumer needs to recover its stream)."""
        await self.discovery.put(pub.scope.key(EVENT_SOURCES, pub.topic, pub.publisher_id),
                                 source_record(pub.scope, pub.topic, pub.publisher_id, metadata), lease=True)

    async def subscribe(self, scope: EndpointScope, topic: str, handler: EnvelopeHandler) -> V1Subscription:
        """Follow every publisher of ``topic`` in ``scope``, now and as they come and go; ``handler`` gets
        each envelope on the event loop (keep it short)."""
        if self.closed:
            raise RuntimeError("the 1.x event plane is closed")
        sub = await V1Subscription(self, scope, topic, handler).start()
        self.subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        self.closed = True
        for sub in list(self.subscriptions):
            await sub.unsubscribe()
        self.publishers.clear()  # their records go with the lease
        self.ctx.destroy(linger=0)
