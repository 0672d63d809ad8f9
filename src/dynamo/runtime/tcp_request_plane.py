"""The request plane over direct TCP (a :class:`~dynamo.runtime.request_plane.RequestPlane` with no broker):
the worker listens, the client dials the address in the instance record.

Why: over NATS every request crosses nats-server and back for its ack, and a fleet needs a NATS server
running first. Here each worker process runs one listener (``DYN_TCP_RPC_HOST`` / ``DYN_TCP_RPC_PORT``,
an ephemeral port by default; loopback only on one machine, :func:`~dynamo.runtime.tcp.listen_hosts`)
for all its endpoints; an endpoint's address is
``tcp://<host>:<port>/<service>.<endpoint>``, written into its instance record. A client keeps one
connection per worker process and sends every request to that process over it.

Wire format: the multiplexed call-home's envelopes (:mod:`.mux`: stream id u64, length u64, payload), in
both directions, the stream id being the request's number on this connection:
  client -> worker: one frame (:mod:`.codec`): header = the endpoint's ``<service>.<endpoint>``, body =
      the request plane's payload (the request frame of :mod:`.transport`, or empty: a ping)
  worker -> client: one frame: header empty and body = the ack (empty: taken), or header
      ``"no_responders"``: nothing is served under that name here (stopped, or a process that reused the
      port), which the client treats as NATS's "no responders".
The request, the acks and what they mean are the NATS plane's, so :mod:`.client` and :mod:`.ingress`
are the same for both. What TCP adds: a refused connect, or a connection that closes before the ack,
is "no responders" at once (the worker is gone); a frozen worker (SIGSTOP) still accepts connections in
its kernel and acks nothing, so it is caught by the ack timeout exactly as over NATS.

Dynamo 1.x peers (docs/runtime.md, "Dynamo 1.x on the request plane"): the same port takes 1.x's framing,
told apart by a connection's first two bytes and handed to :mod:`.v1_request_plane`; an instance whose
address is 1.x's (``host:port/{id:x}/{ns}/{comp}/{ep}``, no scheme) is sent to in 1.x's framing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Generic, Protocol, TypeVar, cast

from dynamo.aio import Acceptor, finish

from . import tcp_tls
from .codec import decode_frame, encode_frame
from .errors import DynamoRuntimeError, ServiceAlreadyExistsError
from .fleet_auth import FleetAuth, FleetAuthError, dial, guarded, is_fleet_hello, peer_name, refusals
from .mux import EnvelopeDecoder, EnvelopeTooLarge, envelope
from .request_plane import NoResponders, RequestHandler, RequestPlaneError
from .tcp import ANY_ADDRESS, CALL_HOME_TIMEOUT, advertise_host, listen, split_address, tune_socket
from .transport import StreamState
from .v1_request_plane import V1ClientConnection, V1ServerConnection, ack_result
from .v1_wire import is_v1_address, looks_like_v1, split_v1_address

log = logging.getLogger(__name__)

SCHEME = "tcp://"
NO_RESPONDERS = b'"no_responders"'
_NO_RESPONDERS_REPLY = encode_frame(header=NO_RESPONDERS)
_EMPTY_ACK = encode_frame()
# The most one request may be: a request is a preprocessed prompt (token ids, sampling options), a few
# hundred kilobytes even for a 128k-token context, and NATS, the other request plane, refuses messages over
# 1 MiB by default; 32 MiB leaves room for large multimodal requests. Announcing more drops the connection
# before a byte of it is buffered.
MAX_REQUEST = 32 * 1024 * 1024
# The most a worker holds, over all its connections, in requests whose end has not arrived yet. Clients send
# each request whole, so this is transient and small; without a fleet secret anyone who reaches the port
# could otherwise open a thousand connections and start a 32 MiB request on each. The connection that
# would take the total over it is dropped.
MAX_PENDING = 256 * 1024 * 1024


def is_tcp_address(address: str) -> bool:
    return address.startswith(SCHEME)


def parse_address(address: str) -> tuple[str, str]:
    """``tcp://host:port/name`` -> (``host:port``, ``name``)."""
    rest = address[len(SCHEME):]
    hostport, sep, name = rest.partition("/")
    if not sep or not name or ":" not in hostport:
        raise ValueError(f"not a TCP request-plane address: {address!r}")
    return hostport, name


class CoalescingWriter:
    """What a connection writes during one loop turn leaves in one ``send`` at the end of the turn: a
    burst of requests (or of their acks) costs one system call, not one each, as nats-py's flusher does
    for the NATS plane."""

    __slots__ = ("transport", "_out", "_loop")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def write(self, data: bytes) -> None:
        if not self._out:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))


async def _rest(call: Any, signal: Any) -> Any:
    return await finish(call, signal)


# ---------------------------------------------------------------------------------- worker side


class TcpIncomingRequest:
    """One request as the worker's handler sees it (the IncomingRequest of the NATS plane)."""

    __slots__ = ("data", "_conn", "_rid")

    def __init__(self, conn: "ServerConnection", rid: int, data: bytes) -> None:
        self.data = data
        self._conn = conn
        self._rid = rid

    async def respond(self, data: bytes = b"") -> None:
        self._conn.reply(self._rid, encode_frame(body=data) if data else _EMPTY_ACK)


class ServerConnection(CoalescingWriter, asyncio.Protocol):
    """A client process's connection to this worker: requests in, acks out."""

    def __init__(self, plane: "TcpRequestPlane") -> None:
        super().__init__()
        self.plane = plane
        self.decoder = EnvelopeDecoder(MAX_REQUEST)
        self.held = 0  # bytes of an unfinished request this connection counts in plane.pending
        self.tasks: set[asyncio.Future] = set()  # handlers running (kept referenced until done)
        self._head = b""  # the first byte, while the second (which tells ours from Dynamo 1.x's) is awaited
        self._sniffed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune_socket(transport)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        self.plane.server_conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.plane.server_conns.discard(self)
        self.plane.pending -= self.held
        self.held = 0

    def _drop(self, reason: str, what: str) -> None:
        """Close this connection, naming the peer and what it did, in at most a line a minute per host."""
        if self.transport is not None:
            peer = peer_name(self.transport)
            refusals((peer.rpartition(":")[0], reason), f"request plane: dropping a connection from {peer}: {what}")
            self.transport.close()

    def _refuse_keyed(self) -> None:
        """A peer that authenticates with a fleet secret, and this process has none: said in one line."""
        if self.transport is not None:
            peer = peer_name(self.transport)
            refusals((peer.rpartition(":")[0], "no secret"), f"request plane: refused a connection from {peer}: it "
                     "authenticates with a fleet secret and this process has none (set DYN_FLEET_SECRET)")
            self.transport.close()

    def _sniff(self, data: bytes) -> bytes | None:
        """The connection's first bytes: ours go on here (returned), Dynamo 1.x's are handed over to a
        :class:`V1ServerConnection` (None; also while only one byte has come)."""
        head = self._head + data
        if len(head) < 2:
            self._head = head
            return None
        self._sniffed = True
        self._head = b""
        transport = self.transport
        if transport is None or not looks_like_v1(head) or is_fleet_hello(head):
            return head
        conn = V1ServerConnection(self.plane, transport, MAX_PENDING)
        self.plane.server_conns.discard(self)
        self.plane.server_conns.add(conn)
        self.transport = None
        transport.set_protocol(conn)
        conn.data_received(head)
        return None

    def data_received(self, data: bytes) -> None:
        if not self._sniffed:
            rest = self._sniff(data)
            if rest is None:
                return
            data = rest
        try:
            envelopes = self.decoder.feed(data)
        except EnvelopeTooLarge as exc:
            if is_fleet_hello(data):  # a fleet secret's hello reads as a huge envelope
                self._refuse_keyed()
            else:
                self._drop("too large", f"it announced a request of {exc.length} bytes (at most {exc.limit} "
                           "accepted)")
            return
        except ValueError as exc:
            if self.transport is not None:
                if is_fleet_hello(data):
                    self._refuse_keyed()
                    return
                # once a minute per peer host: a flood of garbage is not a flood of lines
                peer = peer_name(self.transport)
                refusals((peer.rpartition(":")[0], "garbage"), f"request plane: dropping a connection from "
                         f"{peer} that sent garbage: {exc}")
                self.transport.close()
            return
        held = self.decoder.buffered
        if held != self.held:
            plane = self.plane
            plane.pending += held - self.held
            self.held = held
            if plane.pending > MAX_PENDING:
                self._drop("pending", f"the requests not yet complete on all connections would exceed "
                           f"{MAX_PENDING} bytes (this one holds {held})")
                return
        handlers = self.plane.handlers
        loop = asyncio.get_running_loop()
        for rid, payload in envelopes:
            try:
                name, body = decode_frame(payload)
            except ValueError as exc:
                peer = peer_name(self.transport) if self.transport is not None else "?"
                refusals((peer.rpartition(":")[0], "undecodable"), f"request plane: undecodable request from "
                         f"{peer}: {exc}")
                continue
            handler = handlers.get(name.decode("utf-8", "replace"))
            if handler is None:
                self.reply(rid, _NO_RESPONDERS_REPLY)
                continue
            # the handler (the ingress) normally acks and returns without waiting: run it here, and make
            # a task of it only if it has to wait (a task per request costs more than the request's ack)
            call: Any = handler(TcpIncomingRequest(self, rid, body))
            try:
                signal = call.send(None)
            except StopIteration:
                continue
            except Exception as exc:  # noqa: BLE001 - a failing handler must not drop the connection
                log.warning("request plane: handler for %s failed: %s", name.decode("utf-8", "replace"), exc)
                continue
            task: asyncio.Future = asyncio.ensure_future(_rest(call, signal), loop=loop)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def reply(self, rid: int, frame: bytes) -> None:
        self.write(envelope(rid, frame))


class TcpEndpoint:
    """One served endpoint; ``stop()`` makes its requests find no responder."""

    def __init__(self, plane: "TcpRequestPlane", name: str, address: str) -> None:
        self.plane = plane
        self.name = name
        self.address = address

    async def stop(self) -> None:
        self.plane.handlers.pop(self.name, None)


# ---------------------------------------------------------------------------------- client side


class ClientConnection(CoalescingWriter, asyncio.Protocol):
    """This process's connection to one worker process: requests out, acks in, by request number."""

    def __init__(self, hostport: str) -> None:
        super().__init__()
        self.hostport = hostport
        self.decoder = EnvelopeDecoder()
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune_socket(transport)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():  # no ack will come: the worker process is gone
            if not fut.done():
                fut.set_exception(NoResponders(self.hostport))

    def data_received(self, data: bytes) -> None:
        try:
            envelopes = self.decoder.feed(data)
        except ValueError as exc:
            if is_fleet_hello(data):
                refusals((self.hostport, "no secret"), f"request plane: {self.hostport} requires a fleet secret "
                         "and this process has none (set DYN_FLEET_SECRET)")
            else:
                log.warning("request plane: %s sent garbage: %s", self.hostport, exc)
            if self.transport is not None:
                self.transport.close()
            return
        waiting = self.waiting
        for rid, payload in envelopes:
            fut = waiting.pop(rid, None)
            if fut is None or fut.done():
                continue  # late (timed out) or the stream's first frame came first
            try:
                header, body = decode_frame(payload)
            except ValueError as exc:
                fut.set_exception(RequestPlaneError(f"undecodable ack from {self.hostport}: {exc}"))
                continue
            if header == NO_RESPONDERS:
                fut.set_exception(NoResponders(self.hostport))
            else:
                fut.set_result(body)

    def send(self, name: bytes, payload: bytes, fut: asyncio.Future) -> int:
        if self.transport is None:
            raise NoResponders(self.hostport)  # lost between the dial and now
        self.next_id += 1
        rid = self.next_id
        self.waiting[rid] = fut
        self.write(envelope(rid, encode_frame(header=name, body=payload)))
        return rid


async def _acknowledged(fut: asyncio.Future[Any], deadline: float, address: str, timeout: float) -> Any:
    """The ack (or first frame) a request waits for, by ``deadline`` (the loop's clock)."""
    try:
        async with asyncio.timeout_at(deadline):
            return await fut
    except TimeoutError:
        raise TimeoutError(f"no acknowledgement from {address} within {timeout:g}s") from None


class _Connection(Protocol):
    closed: bool
    transport: asyncio.Transport | None


C = TypeVar("C", bound=_Connection)


class ConnectionPool(Generic[C]):
    """A client's connections, one per worker process (``host:port``), each dialed once however many
    requests wait for it: requests share a connection (ours multiplexed, 1.x's in order), and a dial per
    request would cost a round trip (and a fleet-secret handshake) each."""

    def __init__(self, dial: Callable[[str], Awaitable[C]]) -> None:
        self._dial = dial
        self._conns: dict[str, C] = {}
        self._dialing: dict[str, asyncio.Future[C]] = {}

    async def get(self, hostport: str, timeout: float) -> C:
        conn = self._conns.get(hostport)
        if conn is not None and not conn.closed:
            return conn
        dialing = self._dialing.get(hostport)
        if dialing is None:
            dialing = self._dialing[hostport] = asyncio.ensure_future(self._open(hostport))
            dialing.add_done_callback(lambda _f: self._dialing.pop(hostport, None))
        try:
            return await asyncio.wait_for(asyncio.shield(dialing), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no connection to {hostport} within {timeout:g}s") from None

    async def _open(self, hostport: str) -> C:
        conn = await self._dial(hostport)
        self._conns[hostport] = conn
        return conn

    def close(self) -> None:
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()


class TcpRequestPlane:
    """Both sides: a listener for the endpoints this process serves (started on the first ``serve``),
    and a connection per worker process for the requests it sends.

    ``fallback`` (the NATS plane, when this process is connected to NATS) carries requests to workers
    whose address is a NATS subject, so a client reaches workers of either plane. With ``serve_on_fallback``
    (a process on the NATS request plane) this process's own endpoints are served over NATS, and this
    plane only sends to the workers whose instance record gives a TCP address."""

    def __init__(self, host: str | None = None, port: int = 0, fallback: Any = None,
                 serve_on_fallback: bool = False, advertise: str | None = None,
                 auth: FleetAuth | None = None) -> None:
        self.auth = auth  # the fleet secret's keys: every connection proves it first (None: no secret)
        self.host = host  # where the listener binds (None: every interface)
        self.advertise = advertise or advertise_host(host)  # the address written into instance records
        self.port = port
        self.fallback = fallback
        self.serving = fallback if serve_on_fallback else None
        self.handlers: dict[str, RequestHandler] = {}
        self.server_conns: set[ServerConnection | V1ServerConnection] = set()
        self.pending = 0  # bytes held in unfinished requests over all server connections (MAX_PENDING)
        self._server: Acceptor | None = None
        self._advertised = ""
        self._listening = asyncio.Lock()
        self._conns: ConnectionPool[ClientConnection] = ConnectionPool(
            lambda hostport: self._dial(hostport, self.auth, lambda: ClientConnection(hostport)))
        # Dynamo 1.x workers: no fleet-secret handshake, a 1.x worker has none (docs/runtime.md, "Dynamo 1.x")
        self._v1_conns: ConnectionPool[V1ClientConnection] = ConnectionPool(
            lambda hostport: self._dial(hostport, None, lambda: V1ClientConnection(hostport)))
        self._services: dict[str, Callable[[Any], Any] | None] = {}
        self._closed = False

    # ------------------------------------------------------------------ client side

    @property
    def connected(self) -> bool:
        """On the NATS plane, NATS's state: a request finding it down waits for it (a blip) rather than
        fail, as before; TCP connections are per worker and need no waiting for."""
        if self._closed:
            return False
        return True if self.serving is None else bool(self.serving.connected)

    async def wait_connected(self, timeout: float) -> bool:
        if self._closed:
            return False
        return True if self.serving is None else bool(await self.serving.wait_connected(timeout))

    async def _dial(self, hostport: str, auth: FleetAuth | None, factory: Callable[[], Any]) -> Any:
        host, port = split_address(hostport)
        try:
            return await dial(auth, hostport, host, port, factory, CALL_HOME_TIMEOUT, "request plane")
        except (OSError, asyncio.TimeoutError, FleetAuthError) as exc:
            # refused: nobody listens there any more (the worker is gone), or it is not of this fleet
            # (another secret); as NATS's "no responders"
            raise NoResponders(f"{hostport}: {exc}") from None

    async def _send_v1(self, address: str, payload: bytes, timeout: float, state: StreamState | None) -> bytes:
        """A request to a Dynamo 1.x worker, in its framing, on this process's connection to it."""
        if self.auth is not None:  # its call-home would be refused by our listener: say so now, not at a deadline
            raise NoResponders(f"{address} is a Dynamo 1.x worker, which has no fleet secret: its response stream "
                               "cannot reach this process, which requires DYN_FLEET_SECRET")
        hostport, path = split_v1_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._v1_conns.get(hostport, timeout)
        if not payload:  # a ping (a probe of an instance set aside): 1.x has none; a live connection answers
            return b""
        fut = loop.create_future()
        if state is not None:
            state.set_waiter(fut)  # the stream's first frame is as good as the ack
        headers = {"x-endpoint-path": path}
        if state is not None:
            headers["request-id"] = state.request_id
            if state.trace:  # 1.x carries the W3C trace context in the message's headers
                headers.update(state.trace)
        conn.send(path, headers, payload, fut)
        try:
            result = await _acknowledged(fut, deadline, address, timeout)
        finally:
            if state is not None:
                state.clear_waiter(fut)
        return ack_result(result, address) if result else b""

    async def send(self, address: str, payload: bytes, timeout: float, state: StreamState | None = None) -> bytes:
        if self._closed:
            raise RequestPlaneError("the request plane is closed")
        if is_v1_address(address):
            return await self._send_v1(address, payload, timeout, state)
        if not is_tcp_address(address):
            if self.fallback is None:
                raise NoResponders(f"{address} is served over NATS and this process has no NATS request plane "
                                   "(start it with --request-plane nats, or the worker with --request-plane tcp)")
            return bytes(await self.fallback.send(address, payload, timeout, state))
        try:
            hostport, name = parse_address(address)
        except ValueError:
            raise NoResponders(address) from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._conns.get(hostport, timeout)
        fut = loop.create_future()
        if state is not None:
            state.set_waiter(fut)  # the stream's first frame is as good as the ack (runtime/ack.py)
        rid = conn.send(name.encode(), payload, fut)
        try:
            result = await _acknowledged(fut, deadline, address, timeout)
        finally:
            conn.waiting.pop(rid, None)
            if state is not None:
                state.clear_waiter(fut)
        return b"" if result is None else bytes(result)

    # ------------------------------------------------------------------ worker side

    async def _listen(self) -> None:
        async with self._listening:
            if self._server is not None:
                return
            bind = self.host or ANY_ADDRESS
            factory = guarded(self.auth, lambda: self._advertised, lambda: ServerConnection(self), "request plane")
            sock = await listen(bind, self.port)  # a fixed port is reused at once after a restart (SO_REUSEADDR)
            # our own accept loop, as the response streams': a burst of connections is accepted in one turn
            self._server = Acceptor(sock, factory, **tcp_tls.acceptor_options("request plane"))
            port = sock.getsockname()[1]
            host = self.advertise
            self._advertised = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            log.info("request plane: listening for requests on %s:%d (reached at tcp://%s)", bind, port,
                     self._advertised)

    @property
    def address(self) -> str:
        """``host:port`` this process's endpoints are reached at (empty until one is served)."""
        return self._advertised

    async def add_service(self, name: str, *, description: str = "",
                          stats_handler: Callable[[Any], Any] | None = None) -> None:
        if self.serving is not None:
            await self.serving.add_service(name, description=description, stats_handler=stats_handler)
            return
        if name in self._services:
            raise ServiceAlreadyExistsError("Service already exists")
        self._services[name] = stats_handler
        if stats_handler is not None:
            self._warn_stats()

    def set_stats_handler(self, name: str, stats_handler: Callable[[Any], Any]) -> None:
        if self.serving is not None:
            self.serving.set_stats_handler(name, stats_handler)
            return
        if name not in self._services:
            raise DynamoRuntimeError("create_service() first")
        self._services[name] = stats_handler
        self._warn_stats()

    @staticmethod
    def _warn_stats() -> None:
        log.warning("a stats handler answers NATS $SRV.STATS requests; the TCP request plane has no such "
                    "request, so nobody will read it (serve load metrics on an endpoint instead)")

    async def serve(self, service: str, endpoint: str, handler: RequestHandler) -> Any:
        if self.serving is not None:
            return await self.serving.serve(service, endpoint, handler)
        if service not in self._services:
            await self.add_service(service)
        await self._listen()
        name = f"{service}.{endpoint}"
        self.handlers[name] = handler
        return TcpEndpoint(self, name, f"{SCHEME}{self._advertised}/{name}")

    async def close(self) -> None:
        self._closed = True
        self.handlers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        for sconn in list(self.server_conns):
            if sconn.transport is not None:
                sconn.transport.close()
        self._conns.close()
        self._v1_conns.close()
        if self.fallback is not None:
            await self.fallback.close()
