"""What both response transports share: the request envelope, stream-message encoding, the
worker-side batching of a stream's writes, and the client-side state of one response stream.

Request (client -> worker, one NATS request per stream): a two-part frame whose header is the control
JSON ``{"id", "request_type": "single_in", "response_type": "many_out", "connection_info":
{"transport", "info": "<JSON string>"}}`` and whose body is the request JSON (the original's envelope). The worker acks
with an empty reply at once, then streams the response to where ``connection_info`` says.

Response stream (worker -> client), each a frame:
  header-only ``{"subject", "stream_type": "response"}``   handshake (TCP only: says which stream)
  header-only ``{"error": null | "<msg>"}``                  prologue: did the handler start?
  data-only   ``{"data": <Annotated>, "complete_final": false}``  one per item
  data-only   ``{"data": {"event": "drained"}, ...}``        (ours) a draining worker stopped the stream:
                                                             no completion marker follows
  data-only   ``{"complete_final": true}``                  the completion marker
  header-only ``"sentinel"``                                 end of stream
  header-only ``"heartbeat"``                                while the stream is idle, when the client
                                                             asked for it (``heartbeat_ms`` in the info)
Control (client -> worker): header-only ``"stop"`` or ``"kill"``.

Worker side, ``TurnBatch``: what a stream writes in one loop turn leaves together at its end.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any, Callable

import orjson

from dynamo.lazyjson import LazyJson

from .annotated import DRAINED_EVENT, Annotated
from .codec import encode_frame
from .errors import EngineError, StreamIncompleteError

# ---------------------------------------------------------------------------------- encoding

_ITEM_PREFIX = b'{"data":{"data":'
_ITEM_SUFFIX = b'},"complete_final":false}'
_dumps = orjson.dumps
_pack_prefix = struct.Struct(">QQQ").pack

FRAME_COMPLETE = encode_frame(body=b'{"complete_final":true}')
FRAME_SENTINEL = encode_frame(header=b'"sentinel"')
FRAME_PROLOGUE_OK = encode_frame(header=b'{"error":null}')
FRAME_STOP = encode_frame(header=b'"stop"')
FRAME_KILL = encode_frame(header=b'"kill"')
FRAME_HEARTBEAT = encode_frame(header=b'"heartbeat"')
CONTROL_FRAMES = {"stop": FRAME_STOP, "kill": FRAME_KILL}
# Replies to a request (the NATS ack): empty = accepted; these refuse it.
ACK_REFUSED = b'{"error":"instance shutting down"}'  # draining: the client treats it as "no responders"
ACK_BUSY = b'{"error":"busy"}'  # at its limit of requests in flight: try another instance
PING = b""  # an empty request: "are you there?", acked (empty) and not served; probes 1.x instances
PROBE_KEY = "probe"  # a request's control key (ours): answer with an empty stream over the response path
# Our worker's ack of a probe: "an empty stream follows". A worker that knows no probes (1.6.1's) acks it as
# taken and sends nothing, so the prober knows not to wait for one.
ACK_PROBE = b"Probe taken: answering over the response path"
# A request's control key (ours) and its value: the client is one of ours and reads our item shapes. A
# request without it comes from a Dynamo 1.x client, which gets 1.x's (the ingress's ``context.v1_peer``).
CLIENT_KEY = "x_client"
CLIENT_OURS = "dynamo-py"


def encode_item(item: Any) -> bytes:
    """One stream item as a data frame. Plain values are wrapped as ``Annotated{data: item}``."""
    if isinstance(item, Annotated):
        body = b'{"data":' + _dumps(item.to_dict()) + b',"complete_final":false}'
    elif type(item) is LazyJson and item.raw is not None:  # its bytes (orjson would see an empty dict)
        body = _ITEM_PREFIX + item.raw + _ITEM_SUFFIX
    else:
        body = _ITEM_PREFIX + _dumps(item) + _ITEM_SUFFIX
    return _pack_prefix(0, len(body), 0) + body  # encode_frame inlined: this runs once per item


def encode_error_item(message: str) -> bytes:
    return encode_item(Annotated.from_error(message))


FRAME_DRAINED = encode_item(Annotated(event=DRAINED_EVENT))


def encode_prologue_error(message: str) -> bytes:
    return encode_frame(header=_dumps({"error": message}))


def encode_handshake(subject: str, heartbeat_ms: int | None = None) -> bytes:
    """``heartbeat_ms`` (our addition) tells the client this worker sends heartbeats while idle."""
    ctl: dict[str, Any] = {"subject": subject, "stream_type": "response"}
    if heartbeat_ms:
        ctl["heartbeat_ms"] = heartbeat_ms
    return encode_frame(header=_dumps(ctl))


def encode_request(request_id: str, connection_info: dict, body: bytes, probe: bool = False) -> bytes:
    """The request frame, marked as our client's (:data:`CLIENT_KEY`). ``probe`` (ours, :data:`PROBE_KEY`):
    not a request but a question, answered by an empty stream over the response path (runtime/probe.py).
    The W3C trace context travels in the message's headers (``StreamState.trace``), as 1.x carries it."""
    control: dict[str, Any] = {
        "id": request_id,
        "request_type": "single_in",
        "response_type": "many_out",
        "connection_info": {
            "transport": connection_info["transport"],
            "info": _dumps(connection_info["info"]).decode(),
        },
        CLIENT_KEY: CLIENT_OURS,
    }
    if probe:
        control[PROBE_KEY] = True
    return encode_frame(_dumps(control), body, with_checksum=True)


def parse_request_control(header: bytes) -> tuple[str, str, dict]:
    """(request id, transport name, connection info dict) from a request frame's header."""
    request_id, transport, info, _control = parse_request_control_full(header)
    return request_id, transport, info


def parse_request_control_full(header: bytes) -> tuple[str, str, dict, dict]:
    """:func:`parse_request_control` and the whole control JSON (Dynamo 1.x adds ``payload_codec``)."""
    control = orjson.loads(header)
    conn = control.get("connection_info") or {}
    info = conn.get("info") or "{}"
    return (str(control.get("id") or ""), conn.get("transport", ""),
            orjson.loads(info) if isinstance(info, str) else info, control)


# ---------------------------------------------------------------------------------- worker side


class TurnBatch:
    """Frames a worker's stream writes during one event-loop turn, handed to ``deliver`` joined, once,
    at the end of the turn: the handshake and prologue (and, over NATS, every frame) leave in one
    write or publish instead of one each. ``flush`` hands them on at once (finish, abort).
    """

    __slots__ = ("frames", "_deliver", "_loop", "_scheduled")

    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self.frames: list[bytes] = []  # queued, not yet handed on
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._scheduled = False

    def queue(self, frame: bytes) -> None:
        """Hand ``frame`` on at the end of this loop turn, with whatever else is queued until then."""
        self.frames.append(frame)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self, *last: bytes) -> None:
        """Hand on what is queued, then ``last``, now (nothing when both are empty)."""
        self._scheduled = False
        frames = self.frames
        frames += last
        if frames:
            data = b"".join(frames) if len(frames) > 1 else frames[0]
            frames.clear()
            self._deliver(data)


# ---------------------------------------------------------------------------------- client side


class StreamState:
    """Client-side state of one response stream, fed by a transport, drained by a ResponseStream.

    Transports append raw Annotated dicts to ``items`` and call ``wake()`` once per batch, so a burst of
    items costs one future wake-up rather than one per item.
    """

    __slots__ = ("request_id", "instance_id", "items", "finished", "error", "connected", "key",
                 "_waiter", "_sender", "_control_backlog", "last_seen", "on_finish", "timer", "paused",
                 "_resume", "quiet", "mux_id", "_loop", "trace")

    HIGH_WATER = 4096  # buffered items before the transport stops reading (backpressure to the worker)
    LOW_WATER = 512

    def __init__(self, request_id: str, instance_id: int | None) -> None:
        self.request_id = request_id
        self.instance_id = instance_id
        self.items: deque[Any] = deque()  # Annotated dicts; bytes: a plain item's JSON (runtime/mux.py)
        self.finished = False
        self.error: BaseException | None = None
        self.connected = False
        self.key = ""
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: Callable[[str], None] | None = None
        self._control_backlog: list[str] = []
        self.last_seen = 0.0
        self.on_finish: Callable[["StreamState"], None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # handshake deadline, cancelled on connect
        self.paused = False
        self._resume: Callable[[], None] | None = None
        self.quiet = 0  # liveness ticks since the worker last sent anything (reset by the transport)
        self.mux_id = 0  # its id on a multiplexed call-home connection (0: not offered; runtime/mux.py)
        self.trace: dict[str, str] | None = None  # W3C headers for the TCP request message (tracing)

    # fed by the transport
    def attach(self, sender: Callable[[str], None]) -> None:
        """The worker is connected; ``sender("stop"|"kill")`` reaches it from now on."""
        self.connected = True
        self._sender = sender
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for kind in self._control_backlog:
            sender(kind)
        self._control_backlog.clear()

    def pause(self, pause_reading: Callable[[], None], resume_reading: Callable[[], None]) -> None:
        """The consumer is behind: stop reading from the transport until it catches up."""
        if not self.paused:
            self.paused = True
            self._resume = resume_reading
            pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            resume, self._resume = self._resume, None
            if resume is not None:
                try:
                    resume()
                except Exception:  # noqa: BLE001 - transport already closed
                    pass

    def set_waiter(self, fut: asyncio.Future) -> None:
        """Before the consumer reads: ``fut`` gets None at the stream's first data (runtime/ack.py)."""
        if self.items or self.finished:
            if not fut.done():
                fut.set_result(None)
        else:
            self._waiter = fut

    def new_waiter(self) -> asyncio.Future:
        """A future that the stream's next data (or its end) completes; the consumer awaits it."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        return fut

    def clear_waiter(self, fut: asyncio.Future) -> None:
        if self._waiter is fut:
            self._waiter = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def complete(self) -> None:
        if not self.finished:
            self.finished = True
            self._done()
        self.wake()

    def fail(self, exc: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self.error = exc
            self._done()
        self.wake()

    def fail_incomplete(self) -> None:
        self.fail(StreamIncompleteError())

    def _done(self) -> None:
        self._sender = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.on_finish is not None:
            self.on_finish(self)

    # used by the consumer
    def send_control(self, kind: str) -> None:
        if self.finished:
            return
        if self._sender is not None:
            self._sender(kind)
        else:
            self._control_backlog.append(kind)

    async def next_raw(self) -> dict:
        """The next raw Annotated dict; raises StopAsyncIteration at a clean end, or the stream's error."""
        while True:
            if self.items:
                if self.paused and len(self.items) < self.LOW_WATER:
                    self.resume()
                return self.items.popleft()
            if self.finished:
                if self.error is not None:
                    raise self.error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


def raise_if_error(ann: dict) -> None:
    if ann.get("event") == "error":
        raise EngineError(Annotated.from_dict(ann).error_message())
