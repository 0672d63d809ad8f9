"""Client of an endpoint: which instances are alive (a discovery watch), which one gets a request
(random / round-robin / direct), and the response stream as an async iterator.

``client.round_robin(req)`` returns a :class:`ResponseStream` at once; the request is sent when the
stream is awaited or first iterated, so both ``async for x in client.generate(req)`` and
``async for x in await client.generate(req)`` (the original binding's style) work.

Health, as this client sees it: an instance whose request found no responder, or whose stream broke, is
*down*; one that did not acknowledge a request or whose stream went silent (frozen: SIGSTOP, a stalled
host) is *set aside*. Either way it gets no new request and is probed with backoff until it answers
again on both paths a request takes, out over the request plane and back over the response path
(:mod:`.probe`), or etcd says it is gone. A down mark also ends at the next etcd update for the endpoint
(as the original), but that alone is not enough: "no responders" also means a live worker that is not
subscribed on NATS *yet*. After a NATS restart every process reconnects on its own retry timer, so a
frontend back before its workers finds nobody on their subjects, while their leases and keys never change
and no etcd update ever comes; without the probe those workers would stay down for good.

Capacity: an instance may announce how many requests it takes at once (:meth:`Client.set_instance_limit`);
round-robin and random skip full instances, and :meth:`Client.wait_for_capacity` queues a caller until one
has room.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
from collections import deque
from typing import Any, Protocol, runtime_checkable

import msgspec
import orjson

from dynamo.aio import cancel_and_wait
from dynamo.bounds import track
from dynamo.lazyjson import LazyJson

from . import tracing
from .annotated import DRAINED_EVENT, ERROR_EVENT, Annotated
from .config import RuntimeSettings
from .context import Context
from .discovery import Discovery, DiscoveryWatch
from .errors import (
    AckTimeoutError,
    DynamoRuntimeError,
    EngineError,
    InstanceNotFoundError,
    NoInstancesError,
    NoRespondersError,
    RuntimeConnectionError,
    StreamIncompleteError,
    StreamStalledError,
    WorkerBusyError,
    WorkerDrainedError,
)
from .instance import Instance
from .names import EndpointId, parse_lease_hex
from .probe import reachable
from .request_plane import NoResponders, RequestPlane, RequestPlaneError
from .response_streams import ResponseStreams
from .tcp_listener import TcpResponseServer
from .transport import ACK_BUSY, StreamState, encode_request

log = logging.getLogger(__name__)

# The ack (the worker acks as soon as its NATS callback runs) is bounded by the runtime's stream liveness
# bound (DYN_STREAM_LIVENESS_S, default 5 s). The call-home after it gets at least 15 s: under heavy load
# it waits on this process's own accept queue (docs/performance.md saw > 15 s with 512 streams at once).
HANDSHAKE_MIN = 15.0
BUSY_BACKOFF = 0.5  # an instance that refused a request as busy gets no new one for this long
PROBE_FIRST = 0.25  # first ping to a set-aside instance; the interval doubles up to the liveness bound
RECONNECT_WAIT = 2.0  # a request finding NATS disconnected waits this long for it (a blip) before failing


def _encode_request(request: Any) -> bytes:
    if isinstance(request, (bytes, bytearray, memoryview)):
        return bytes(request)  # already JSON
    try:
        return orjson.dumps(request)
    except TypeError:
        return msgspec.json.encode(request)


@runtime_checkable
class PeerBody(Protocol):
    """A request body that a Dynamo 1.x worker may not be given whole: ours take :meth:`body`; a 1.x worker
    gets :meth:`v1_body`, the same body, which may raise instead (a :class:`~dynamo.errors.RequestError` naming
    what a 1.x worker would ignore and so answer something else).  The runtime knows only whether an
    instance's record says it is ours (:meth:`Client.known_only_to_1x`); what the body means is the
    caller's (the frontend's LLM requests)."""

    def body(self) -> Any: ...

    def v1_body(self) -> Any: ...


def _request_bytes(request: Any, v1: bool) -> bytes:
    """The request's payload (JSON, the one codec between our processes and the one a 1.x worker is sent)
    for the chosen instance: the one body, or refused for a 1.x worker (:class:`PeerBody`)."""
    if isinstance(request, PeerBody):
        request = request.v1_body() if v1 else request.body()
    return _encode_request(request)


class Client:
    """Routes requests to the live instances of one endpoint.

    It needs no runtime, only its parts: the settings, the request plane (requests, acks, pings), the
    response streams (where streams come back) and, unless static, the discovery store it follows the
    endpoint's instances in (``Endpoint.client()`` passes the runtime's)."""

    def __init__(self, endpoint: EndpointId, *, settings: RuntimeSettings, requests: RequestPlane,
                 streams: ResponseStreams | None = None, discovery: Discovery | None = None,
                 static: bool = False) -> None:
        self.endpoint_id = endpoint
        self.settings = settings
        self.requests = requests
        self.streams = streams
        self.discovery = discovery
        self.is_static = static
        self._instances: dict[int, Instance] = {}
        self._invalid: set[str] = set()  # keys of records that are not instances we can reach, already said
        self._down: set[int] = set()
        self._available: list[int] = []
        self._counter = 0
        self._changed = asyncio.Event()
        self._watch: DiscoveryWatch | None = None
        self._task: asyncio.Task | None = None
        self._active: dict[int, set[StreamState]] = {}
        self._aside: set[int] = set()  # instances that did not ack or went silent (frozen?)
        self._probes: dict[int, asyncio.Task] = {}  # down or set-aside instance -> the task pinging it
        self._limits: dict[int, int] = {}  # instance -> requests it takes at once (what it announced)
        self._busy_until: dict[int, float] = {}  # instance -> loop time until which it is treated as full
        self._waiters: deque[asyncio.Future] = deque()  # callers queued for capacity, first come first served
        track("client_streams", self, lambda c: sum(len(v) for v in c._active.values()))
        track("client_capacity_waiters", self, lambda c: len(c._waiters))

    async def _start(self) -> "Client":
        if self.is_static:
            return self
        if self.discovery is None:
            raise ValueError("a client that follows instances needs a discovery store (or static=True)")
        # every worker's v1/instances record, ours and Dynamo 1.x's (the slash keeps "gen" from matching
        # "generate")
        self._watch = await self.discovery.watch_prefix(self.endpoint_id.etcd_prefix + "/").start()
        for kv in self._watch.initial:
            self._apply_put(kv.key, kv.value)
        self._recompute()
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"client-watch:{self.endpoint_id}")
        return self

    async def _follow(self) -> None:
        assert self._watch is not None
        async for ev in self._watch:
            if ev.initial:
                continue  # already applied in _start
            if ev.kind == "put":
                self._apply_put(ev.key, ev.value)
            else:
                self._invalid.discard(ev.key)
                iid = self._id_from_key(ev.key)
                if iid is not None:
                    self._instances.pop(iid, None)
                    self._forget(iid)
                    if self.streams is not None:
                        self.streams.on_instance_gone(list(self._active.get(iid, ())))
            self._down.clear()  # as the original: a watch update resets "down" marks
            for iid in [i for i in self._probes if i not in self._aside]:
                self._stop_probe(iid)
            self._recompute()

    def _apply_put(self, key: str, value: bytes) -> None:
        try:
            inst = Instance.from_json(value)
        except Exception as exc:  # noqa: BLE001 - a foreign/garbled key must not kill the watch
            if key not in self._invalid:
                self._invalid.add(key)
                log.warning("ignoring instance record %s: %s", key, exc)
            return
        self._instances[inst.instance_id] = inst

    @staticmethod
    def _id_from_key(key: str) -> int | None:
        _, _, tail = key.rpartition("/")
        try:
            return parse_lease_hex(tail)
        except ValueError:
            return None

    def _recompute(self) -> None:
        self._available = sorted(i for i in self._instances if i not in self._down and i not in self._aside)
        self._changed.set()
        self._changed = asyncio.Event()
        self._wake_waiters(everyone=True)

    def _forget(self, instance_id: int) -> None:
        self._stop_probe(instance_id)
        self._aside.discard(instance_id)
        self._down.discard(instance_id)
        self._limits.pop(instance_id, None)
        self._busy_until.pop(instance_id, None)

    # ------------------------------------------------------------------ instance list

    def instance_ids(self) -> list[int]:
        """Ids of the instances requests may go to now (live and not reported down)."""
        return [0] if self.is_static else list(self._available)

    def instances(self) -> list[Instance]:
        return [self._instances[i] for i in self._available if i in self._instances]

    def report_instance_down(self, instance_id: int) -> None:
        """Skip this instance until it answers a ping or the next etcd update for the endpoint.

        The ping matters when etcd stays quiet: a worker that is alive but not (yet) subscribed on NATS,
        e.g. still reconnecting after a NATS restart, answers "no responders" exactly like a dead one."""
        if instance_id in self._instances and not self.is_static:
            self._down.add(instance_id)
            self._available = [i for i in self._available if i != instance_id]
            self._start_probe(instance_id)

    def report_instance_unresponsive(self, instance_id: int, silent: bool = False) -> None:
        """Set aside an instance that did not ack or went silent mid-stream; probe it until it answers.

        ``silent``: a stream of it went silent (its host cut off, or frozen): its other requests that have
        not called home yet will not either, so they fail now (and move on) rather than after the
        call-home bound (15 s); nothing of theirs has reached the caller, and their stream keys are
        withdrawn, so a late call-home is turned away."""
        if silent and not self.is_static:
            for state in [s for s in self._active.get(instance_id, ()) if not s.connected and not s.finished]:
                state.fail(StreamStalledError())
        if instance_id not in self._instances or instance_id in self._aside or self.is_static:
            return
        log.warning("instance %x of %s is not responding; no new requests go to it until it answers again",
                    instance_id & 0xFFFFFFFFFFFFFFFF, self.endpoint_id)
        self._aside.add(instance_id)
        self._available = [i for i in self._available if i != instance_id]
        self._start_probe(instance_id)

    def _start_probe(self, instance_id: int) -> None:
        if instance_id not in self._probes:
            self._probes[instance_id] = asyncio.get_running_loop().create_task(
                self._probe(instance_id), name=f"probe:{instance_id & 0xFFFFFFFFFFFFFFFF:x}")

    def _stop_probe(self, instance_id: int) -> None:
        probe = self._probes.pop(instance_id, None)
        if probe is not None:
            probe.cancel()

    async def _probe(self, instance_id: int) -> None:
        bound = self.settings.stream_liveness
        delay = min(PROBE_FIRST, bound)
        while True:
            await asyncio.sleep(delay)
            inst = self._instances.get(instance_id)
            if inst is None:  # gone from etcd meanwhile (_forget normally cancels us first)
                self._probes.pop(instance_id, None)
                return
            try:
                receiver = await self.streams.receiver() if self.streams is not None else None
                answers = await reachable(self.requests, receiver, inst.subject or self.endpoint_id.subject(instance_id),
                                          instance_id, bound)
            except Exception as exc:  # noqa: BLE001 - timeout, no responders, NATS away: still not healthy
                log.debug("probe of instance %x: %s", instance_id & 0xFFFFFFFFFFFFFFFF, type(exc).__name__)
            else:
                if answers:
                    log.info("instance %x of %s answers again; sending it requests",
                             instance_id & 0xFFFFFFFFFFFFFFFF, self.endpoint_id)
                    self._probes.pop(instance_id, None)
                    self._aside.discard(instance_id)
                    self._down.discard(instance_id)
                    self._recompute()
                    return
            delay = min(delay * 2, bound)

    # ------------------------------------------------------------------ capacity

    def set_instance_limit(self, instance_id: int, limit: int | None) -> None:
        """How many requests ``instance_id`` takes at once (from its model entry); None: no known limit."""
        if limit is not None and limit > 0:
            self._limits[instance_id] = int(limit)
        else:
            self._limits.pop(instance_id, None)
        self._wake_waiters(everyone=True)

    def _has_room(self, instance_id: int) -> bool:
        limit = self._limits.get(instance_id)
        if limit is not None and len(self._active.get(instance_id, ())) >= limit:
            return False
        until = self._busy_until.get(instance_id)
        if until is not None:
            if until > asyncio.get_running_loop().time():
                return False
            del self._busy_until[instance_id]
        return True

    def free_instance_ids(self) -> list[int]:
        """Available instances with room for one more request (all available ones when none has a limit)."""
        if not self._limits and not self._busy_until:
            return list(self._available)
        return [i for i in self._available if self._has_room(i)]

    def queued(self) -> int:
        """Callers waiting in :meth:`wait_for_capacity` now."""
        return len(self._waiters)

    def must_wait(self) -> bool:
        """Whether :meth:`wait_for_capacity` would queue a caller now (every available instance is full,
        or others wait already)."""
        return not (self.is_static or (not self._waiters and (not self._available or self.free_instance_ids())))

    async def wait_for_capacity(self, deadline: float, max_waiters: int) -> bool:
        """Wait, first come first served, until an available instance has room (or none is available:
        the caller then handles "no instances"). ``deadline`` is in loop time. False when the queue
        already holds ``max_waiters`` callers or the deadline passed."""
        if not self.must_wait():
            return True
        if len(self._waiters) >= max_waiters:
            return False
        loop = asyncio.get_running_loop()
        first = False
        while True:
            fut = loop.create_future()
            if first:
                self._waiters.appendleft(fut)  # woken but beaten to the slot: keep our place
            else:
                self._waiters.append(fut)
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            except BaseException as exc:  # timed out, or the request was cancelled (client went away)
                if fut.done() and not fut.cancelled():
                    self._wake_waiters()  # woken, but we will not take the slot: pass it on
                else:
                    fut.cancel()
                    try:
                        self._waiters.remove(fut)
                    except ValueError:
                        pass
                if isinstance(exc, TimeoutError):
                    return False
                raise
            if not self._available or self.free_instance_ids():
                if self._waiters and self.free_instance_ids():
                    self._wake_waiters()  # more room than one request: pass it on
                return True
            first = True

    def _wake_waiters(self, everyone: bool = False) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                if not everyone:
                    return

    def _mark_busy(self, instance_id: int) -> None:
        loop = asyncio.get_running_loop()
        self._busy_until[instance_id] = loop.time() + BUSY_BACKOFF
        loop.call_later(BUSY_BACKOFF, self._wake_waiters, True)

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        """Wait until at least one instance is available; returns their ids."""
        if self.is_static:
            return [0]

        async def wait() -> list[int]:
            while not self._available:
                await self._changed.wait()
            return list(self._available)

        return await asyncio.wait_for(wait(), timeout) if timeout is not None else await wait()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for iid in list(self._probes):
            self._stop_probe(iid)
        if self._watch is not None:
            await self._watch.close()
            self._watch = None

    # ------------------------------------------------------------------ routing

    def known_only_to_1x(self, instance_id: int) -> bool:
        """Whether the instance is a Dynamo 1.x worker's (its record does not say it is ours), sent a
        :class:`PeerBody`'s ``v1_body``. (The one thing the client still tells apart: the wire and the body are
        the same for every worker, but a 1.x worker ignores our fields.)"""
        inst = self._instances.get(instance_id)
        return inst is not None and not inst.ours

    def _select(self, mode: str, instance_id: int | None) -> tuple[int, str]:
        ep = self.endpoint_id
        if self.is_static:
            return 0, ep.subject(None)
        ids = self._available
        if mode == "direct":
            assert instance_id is not None
            inst = self._instances.get(instance_id)
            if inst is None or instance_id not in ids:
                raise InstanceNotFoundError(instance_id, ep.etcd_prefix)
            return instance_id, inst.subject or ep.subject(instance_id)
        if not ids:
            raise NoInstancesError(ep.etcd_prefix)
        if self._limits or self._busy_until:
            ids = self.free_instance_ids() or ids  # all full (a race with another caller): the worker decides
        if mode == "round_robin":
            chosen = ids[self._counter % len(ids)]
            self._counter += 1
        else:
            chosen = ids[_random.randrange(len(ids))]
        inst = self._instances[chosen]
        return chosen, inst.subject or ep.subject(chosen)

    def random(self, request: Any, *, context: Context | None = None, annotated: bool = False,
              lazy: bool = False) -> "ResponseStream":
        return ResponseStream(self, request, "random", None, context, annotated, lazy)

    def round_robin(self, request: Any, *, context: Context | None = None, annotated: bool = False,
                   lazy: bool = False) -> "ResponseStream":
        return ResponseStream(self, request, "round_robin", None, context, annotated, lazy)

    def direct(self, request: Any, instance_id: int, *, context: Context | None = None,
               annotated: bool = False, lazy: bool = False) -> "ResponseStream":
        return ResponseStream(self, request, "direct", instance_id, context, annotated, lazy)

    def generate(self, request: Any, *, context: Context | None = None, annotated: bool = False,
                lazy: bool = False) -> "ResponseStream":
        """Random instance (the static subject for static clients), as the original binding does.

        ``lazy=True`` (any of these methods): JSON-object items may come as :class:`LazyJson`, decoded
        when first looked into, their bytes at hand for passing on (dynamo/lazyjson.py)."""
        return ResponseStream(self, request, "random", None, context, annotated, lazy)

    def _track(self, state: StreamState) -> None:
        if state.instance_id is not None:
            self._active.setdefault(state.instance_id, set()).add(state)

    def _untrack(self, state: StreamState) -> None:
        bucket = self._active.get(state.instance_id)  # type: ignore[arg-type]
        if bucket is not None:
            bucket.discard(state)
            if not bucket:
                self._active.pop(state.instance_id, None)  # type: ignore[arg-type]
        if self._waiters:
            self._wake_waiters()  # a slot freed: the first queued caller may go


def _request_span(ctx: Context, endpoint: Any, instance_id: int) -> tracing.Span | None:
    """The request-plane client span of one request to ``instance_id``: a child of the context's span (or
    of this task's current one), ended with the stream; the worker's spans are its children."""
    parent = ctx.trace or tracing.current()
    if parent is None:
        return None
    return tracing.start_span(f"dynamo.request_plane {endpoint}", parent, kind=tracing.CLIENT, attributes={
        "rpc.system": "dynamo", "rpc.service": str(endpoint), "dynamo.request_id": ctx.id(),
        "dynamo.worker_id": f"{instance_id & 0xFFFFFFFFFFFFFFFF:x}"})


class ResponseStream:
    """One request's response stream: an async iterator of items (or Annotated with ``annotated=True``).

    Iteration raises :class:`EngineError` for an error item (the handler failed) and
    :class:`StreamIncompleteError` when the worker went away before the completion marker
    (:class:`WorkerDrainedError` when it stopped the stream because it is shutting down). Leaving the
    stream early (``break``, ``aclose()``, cancellation, garbage collection) sends ``kill`` so the worker
    stops the handler.
    """

    __slots__ = ("_client", "_request", "_mode", "_instance_id", "_context", "_annotated", "_state",
                 "_starting", "_closed", "_lazy", "__weakref__")

    def __init__(self, client: Client, request: Any, mode: str, instance_id: int | None,
                 context: Context | None, annotated: bool, lazy: bool = False) -> None:
        self._client = client
        self._request = request
        self._mode = mode
        self._instance_id = instance_id
        self._context = context or Context()
        self._annotated = annotated
        self._state: StreamState | None = None
        self._starting: asyncio.Future | None = None
        self._closed = False
        self._lazy = lazy and not annotated

    @property
    def instance_id(self) -> int | None:
        """The instance serving this stream (known once started)."""
        return self._state.instance_id if self._state is not None else self._instance_id

    @property
    def context(self) -> Context:
        return self._context

    def id(self) -> str:
        return self._context.id()

    async def start(self) -> "ResponseStream":
        """Choose the instance and send the request (idempotent)."""
        if self._state is not None:
            return self
        if self._starting is not None:
            await self._starting
            return self
        self._starting = asyncio.get_running_loop().create_future()
        try:
            await self._send()
            self._starting.set_result(None)
        except BaseException as exc:
            self._starting.set_exception(exc)
            self._starting.exception()  # mark retrieved
            self._closed = True
            raise
        return self

    async def _send(self) -> None:
        client = self._client
        requests = client.requests
        if not requests.connected and not await requests.wait_connected(RECONNECT_WAIT):
            # NATS is away: fail now rather than after the ack timeout (and blaming the instance)
            raise RuntimeConnectionError("NATS is not connected; cannot send the request to a worker")
        instance_id, subject = client._select(self._mode, self._instance_id)
        if client.streams is None:
            raise RuntimeConnectionError("this client has no response streams to receive on")
        receiver = await client.streams.receiver()
        ctx = self._context
        state = StreamState(ctx.id(), instance_id)
        peer_1x = client.known_only_to_1x(instance_id)
        payload = _request_bytes(self._request, peer_1x)  # before any bookkeeping: a body 1.x cannot take raises
        if peer_1x:
            if not isinstance(receiver, TcpResponseServer):
                raise DynamoRuntimeError(f"instance {instance_id & 0xFFFFFFFFFFFFFFFF:x} is a Dynamo 1.x worker, "
                                         "which streams responses over TCP call-home only, and this process "
                                         "receives them over NATS (unset DYN_RESPONSE_TRANSPORT)")
            if receiver.auth is not None:  # said now, not at the deadline of a handshake it cannot answer
                client.report_instance_down(instance_id)
                raise NoRespondersError(f"{subject} (a Dynamo 1.x worker, which has no fleet secret: it cannot "
                                        "take part in this process's fleet, which requires DYN_FLEET_SECRET)",
                                        instance_id)
        conn = receiver.register(state)  # our extras offered; the worker's call-home says which it honours

        span = _request_span(ctx, self._client.endpoint_id, instance_id) if tracing.ENABLED else None

        def finished(s: StreamState) -> None:
            receiver.unregister(s)
            ctx.remove_callback(s.send_control)
            client._untrack(s)
            if span is not None:
                if s.error is not None:
                    tracing.fail(span, str(s.error) or type(s.error).__name__)
                span.end()

        # All bookkeeping before the request leaves: a fast worker may finish the whole stream
        # before we have even processed its ack.
        state.on_finish = finished
        client._track(state)
        if ctx.is_stopped():
            state.send_control("kill" if ctx.is_killed() else "stop")  # queued until the worker attaches
        ctx.add_callback(state.send_control)
        trace = tracing.headers_of(span) if span is not None else None
        state.trace = trace  # in the request message's headers, on either plane
        frame = encode_request(ctx.id(), conn, payload)
        bound = client.settings.stream_liveness
        try:
            ack = await requests.send(subject, frame, bound, state)  # or the first frame
            if ack:
                if ack == ACK_BUSY:
                    client._mark_busy(instance_id)
                    raise WorkerBusyError(subject, instance_id)
                raise NoResponders(subject)  # a draining worker refuses: as good as gone
        except NoResponders:
            client.report_instance_down(instance_id)
            error: BaseException = NoRespondersError(subject, instance_id)
            state.fail(error)
            raise error from None
        except TimeoutError:
            # withdrawing the stream key (state.fail) turns a late call-home away: safe to send elsewhere
            client.report_instance_unresponsive(instance_id)
            error = AckTimeoutError(subject, instance_id, bound)
            state.fail(error)
            raise error from None
        except RequestPlaneError as exc:  # NATS connection closed / reconnecting: nothing reached a worker
            error = RuntimeConnectionError(str(exc))
            state.fail(error)
            raise error from None
        except BaseException as exc:
            state.fail(exc)
            raise
        self._state = state
        receiver.after_send(state, max(HANDSHAKE_MIN, 3 * bound))

    def __await__(self):
        return self.start().__await__()

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> Any:
        state = self._state
        if state is None:
            if self._closed:
                raise StopAsyncIteration
            await self.start()
            state = self._state
            assert state is not None
        items = state.items
        try:
            while True:
                if items:
                    ann = items.popleft()
                    if state.paused and len(items) < state.LOW_WATER:
                        state.resume()
                elif state.finished:
                    if state.error is not None:
                        raise state.error
                    raise StopAsyncIteration
                else:
                    # StreamState.next_raw, inlined: a frame and a get_running_loop less per token
                    fut = state.new_waiter()
                    try:
                        await fut
                    finally:
                        state.clear_waiter(fut)
                    continue
                if type(ann) is bytes:  # a plain item's JSON (multiplexed connection, runtime/mux.py)
                    if self._lazy and ann[:1] == b"{":
                        return LazyJson(ann)
                    if self._annotated:
                        return Annotated(data=orjson.loads(ann))
                    return orjson.loads(ann)
                if "event" in ann:
                    event = ann["event"]
                    if event == ERROR_EVENT:
                        raise EngineError(Annotated.from_dict(ann).error_message())
                    if event == DRAINED_EVENT:  # the worker ends the stream here; what follows is noise
                        drained = WorkerDrainedError()
                        state.fail(drained)
                        raise drained
                if self._annotated:
                    return Annotated.from_dict(ann)
                if "data" in ann:
                    return ann["data"]
                # an annotation without data (events/comments) only shows in annotated mode
        except StopAsyncIteration:
            self._closed = True
            raise
        except asyncio.CancelledError:
            self._abandon()
            raise
        except StreamIncompleteError as exc:
            self._closed = True
            if state.instance_id:
                if isinstance(exc, StreamStalledError):
                    self._client.report_instance_unresponsive(state.instance_id, silent=True)
                else:
                    self._client.report_instance_down(state.instance_id)
            raise

    def stop_generating(self) -> None:
        """Ask the worker to end the stream gracefully; keep iterating to get the rest."""
        self._context.stop_generating()

    def kill(self) -> None:
        """Abandon the stream: the worker cancels the handler."""
        self._abandon()

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if self._closed:
            return
        self._closed = True
        state = self._state
        if state is not None and not state.finished:
            state.send_control("kill")  # the caller's Context is left alone: it may outlive this stream
            state.fail(EngineError("stream abandoned by the client"))

    async def __aenter__(self) -> "ResponseStream":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        self._abandon()

    def __del__(self) -> None:
        state = self._state
        if state is not None and not state.finished:
            try:
                state.send_control("kill")
                state.fail(EngineError("stream abandoned by the client"))
            except Exception:  # noqa: BLE001 - interpreter/loop shutting down
                pass
