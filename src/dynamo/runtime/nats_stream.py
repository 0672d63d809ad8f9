"""NATS response streams: the alternative to TCP call-home (``DYN_RESPONSE_TRANSPORT=nats``).

The worker publishes the same frames as over TCP, coalesced per event-loop turn, to a per-request
subject under the client's wildcard subscription. NATS gives no connection to watch, so liveness is
explicit: the client asks for a heartbeat every bound / 5 (``heartbeat_ms`` in the connection info, as
over TCP), the worker sends one on a stream that has been quiet that long (HEARTBEAT seconds for a
client that does not ask), and the client fails a stream that has been silent for its liveness bound
(``DYN_STREAM_LIVENESS_S``) or whose instance key vanished from etcd. ``stop``/``kill`` go to a per-worker control subject announced in the prologue.

Kept because it was measured against TCP (docs/runtime.md, "Transport") and works without the worker
being able to dial the client; TCP is the default.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import orjson
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from .codec import FrameDecoder
from .context import Context
from .errors import EngineError, StreamStalledError
from .nats_conn import subscriptions_live
from .transport import FRAME_COMPLETE, FRAME_HEARTBEAT, FRAME_SENTINEL, StreamState, TurnBatch, encode_frame

log = logging.getLogger(__name__)

TRANSPORT_NAME = "nats"
HEARTBEAT = 1.5  # a worker's heartbeat interval when the client does not ask for one
LIVENESS = 5.0  # the client's default liveness bound (the runtime passes DYN_STREAM_LIVENESS_S)
LIVENESS_TICKS = 4  # the client checks its streams LIVENESS_TICKS times per liveness bound
HEARTBEATS_PER_BOUND = 5
FRAME_ABORT = encode_frame(header=b'"abort"')
_loads = orjson.loads


def _split(payload: bytes) -> list[tuple[bytes, bytes]]:
    return FrameDecoder().feed(payload)


class NatsResponseReceiver:
    """Client side: one wildcard subscription for every response stream of this process."""

    def __init__(self, nc: NatsClient, liveness: float = LIVENESS) -> None:
        self.nc = nc
        self.liveness = liveness
        self._heartbeat_ms = max(1, int(liveness * 1000 / HEARTBEATS_PER_BOUND))
        self.prefix = f"_DYN_RESP.{uuid.uuid4().hex}"
        self.streams: dict[str, StreamState] = {}
        self._sub: Subscription | None = None
        self._task: asyncio.Task | None = None
        self.address = ""

    async def start(self) -> None:
        if self._sub is not None:
            return
        self._sub = await self.nc.subscribe(self.prefix + ".*", cb=self._on_msg, pending_msgs_limit=1_000_000,
                                            pending_bytes_limit=1 << 30)
        await subscriptions_live(self.nc)
        self._task = asyncio.get_running_loop().create_task(self._liveness())
        self.address = self.prefix

    def register(self, state: StreamState) -> dict:
        key = uuid.uuid4().hex
        state.key = key
        state.last_seen = time.monotonic()
        self.streams[key] = state
        return {"transport": TRANSPORT_NAME, "info": {"subject": f"{self.prefix}.{key}", "context": state.request_id,
                                                      "heartbeat_ms": self._heartbeat_ms}}

    def unregister(self, state: StreamState) -> None:
        self.streams.pop(state.key, None)

    def after_send(self, state: StreamState, handshake_timeout: float) -> None:
        state.last_seen = time.monotonic()

    def on_instance_gone(self, states: list[StreamState]) -> None:
        for state in states:
            state.fail_incomplete()

    async def _on_msg(self, msg) -> None:
        key = msg.subject.rpartition(".")[2]
        state = self.streams.get(key)
        if state is None:
            return
        state.last_seen = time.monotonic()
        for header, body in _split(msg.data):
            if body:
                m = _loads(body)
                ann = m.get("data")
                if ann is not None:
                    if not state.finished:
                        state.items.append(ann)
                elif m.get("complete_final"):
                    state.complete()
            elif header:
                ctl = _loads(header)
                if isinstance(ctl, dict):
                    if ctl.get("error"):
                        state.fail(EngineError(str(ctl["error"])))
                    control = ctl.get("control")
                    if control and not state.connected:
                        state.attach(self._sender(control, key))
                elif ctl == "abort":
                    state.fail_incomplete()
        state.wake()

    def _sender(self, control_subject: str, key: str):
        nc = self.nc

        def send(kind: str) -> None:
            payload = orjson.dumps({"key": key, "ctl": kind})
            asyncio.get_running_loop().create_task(nc.publish(control_subject, payload))

        return send

    async def _liveness(self) -> None:
        """Fail streams whose worker sent nothing, not even a heartbeat, for longer than the bound."""
        while True:
            await asyncio.sleep(self.liveness / LIVENESS_TICKS)
            cutoff = time.monotonic() - self.liveness
            for state in list(self.streams.values()):
                if state.last_seen < cutoff and not state.finished:
                    log.warning("response stream %s: no data or heartbeat from worker %x for %.1fs; treating it "
                                "as dead", state.request_id, (state.instance_id or 0) & 0xFFFFFFFFFFFFFFFF,
                                self.liveness)
                    state.send_control("kill")  # a worker that wakes up stops at once
                    state.fail(StreamStalledError())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for state in list(self.streams.values()):
            state.fail_incomplete()
        self.streams.clear()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
            self._sub = None


class NatsSinkHub:
    """Worker side: the control subscription and heartbeats shared by every NATS sink of a runtime."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self.control_subject = f"_DYN_CTL.{uuid.uuid4().hex}"
        self.sinks: dict[str, "NatsSink"] = {}
        self._sub: Subscription | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self.nc.subscribe(self.control_subject, cb=self._on_control)
            self._task = asyncio.get_running_loop().create_task(self._heartbeats())

    async def open(self, transport: str, info: dict, context: Context) -> "NatsSink":
        await self.start()
        sink = NatsSink(self, str(info["subject"]), context)
        heartbeat_ms = info.get("heartbeat_ms")
        if type(heartbeat_ms) is int and heartbeat_ms > 0:  # the client's bound / 5 (absent: an older client)
            sink.heartbeat = heartbeat_ms / 1000
        self.sinks[sink.key] = sink
        return sink

    async def _on_control(self, msg) -> None:
        ctl = _loads(msg.data)
        sink = self.sinks.get(ctl.get("key", ""))
        if sink is not None:
            if ctl.get("ctl") == "kill":
                sink.context.kill()
            elif ctl.get("ctl") == "stop":
                sink.context.stop_generating()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(min((sink.heartbeat for sink in self.sinks.values()), default=HEARTBEAT) / 2)
            now = time.monotonic()
            for sink in list(self.sinks.values()):
                if sink.last_sent < now - sink.heartbeat:
                    sink.write(FRAME_HEARTBEAT)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass


class NatsSink:
    """Worker end of one NATS response stream (same interface as TcpSink)."""

    must_drain = False

    def __init__(self, hub: NatsSinkHub, subject: str, context: Context) -> None:
        self.hub = hub
        self.subject = subject
        self.key = subject.rpartition(".")[2]
        self.context = context
        self.finished = False
        self.last_sent = time.monotonic()
        self.heartbeat = HEARTBEAT  # seconds of quiet before a heartbeat frame
        self._batch = TurnBatch(self._publish)
        self._outbox: list[bytes] = []
        self._sender: asyncio.Task | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, frame: bytes) -> None:
        self._batch.queue(frame)

    def _publish(self, data: bytes) -> None:
        self._outbox.append(data)
        self.last_sent = time.monotonic()
        if self._sender is None or self._sender.done():
            self._sender = self._loop.create_task(self._send_all())

    async def _send_all(self) -> None:
        publish = self.hub.nc.publish
        while self._outbox:
            data = self._outbox.pop(0)
            try:
                await publish(self.subject, data)
            except Exception as exc:  # noqa: BLE001 - NATS gone: the client's liveness check fires
                log.debug("publish failed: %s", exc)
                return

    async def drain(self) -> None:
        return None

    def send_prologue(self, error: str | None = None) -> None:
        self.write(encode_frame(header=orjson.dumps({"error": error, "control": self.hub.control_subject})))

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._batch.flush(FRAME_COMPLETE, FRAME_SENTINEL)
        self.hub.sinks.pop(self.key, None)

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._batch.flush(FRAME_ABORT)
        self.hub.sinks.pop(self.key, None)
