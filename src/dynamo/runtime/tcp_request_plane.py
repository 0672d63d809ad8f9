"""The request plane over direct TCP (a :class:`~dynamo.runtime.request_plane.RequestPlane` with no broker):
the worker listens, the client dials the address in the instance record.

Why: over NATS every request crosses nats-server and back for its ack, and a fleet needs a NATS server
running first. Here each worker process runs one listener (``DYN_TCP_RPC_HOST`` / ``DYN_TCP_RPC_PORT``,
an ephemeral port by default; loopback only on one machine, :func:`~dynamo.runtime.tcp.listen_hosts`)
for all its endpoints; an endpoint's address is Dynamo 1.x's transport string
``host:port/{instance_id:x}/{namespace}/{component}/{endpoint}`` (what its ``v1/instances`` record
carries), the path naming the endpoint on that port. A client keeps one connection per worker process and
sends every request to that process over it.

Wire format: Dynamo 1.x's (:mod:`.v1_wire`, the connections :mod:`.tcp_connections`), for every client and
every worker, ours or 1.6.1's: a message per request (the path, JSON headers: ``x-endpoint-path``,
``request-id``, a W3C ``traceparent``; the payload), an ack per request in request order. The request,
the acks and what they mean are the NATS plane's, so :mod:`.client` and :mod:`.ingress` are the same for
both. What TCP adds: a refused connect, or a connection that closes before the ack, is "no responders" at
once (the worker is gone); a frozen worker (SIGSTOP) still accepts connections in its kernel and acks
nothing, so it is caught by the ack timeout exactly as over NATS. With a fleet secret, its handshake
(:mod:`.fleet_auth`) comes before the first request on every connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, cast

from dynamo.aio import Acceptor

from . import tcp_tls
from .errors import DynamoRuntimeError, ServiceAlreadyExistsError
from .fleet_auth import FleetAuth, FleetAuthError, dial, guarded
from .names import is_v1_tcp_address
from .request_plane import NoResponders, RequestHandler, RequestPlaneError
from .tcp import ANY_ADDRESS, CALL_HOME_TIMEOUT, advertise_host, listen, split_address
from .tcp_connections import ClientConnection, ServerConnection, ack_result
from .transport import StreamState
from .v1_wire import MAX_REQUEST, split_v1_address

log = logging.getLogger(__name__)

__all__ = ["MAX_REQUEST", "MAX_PENDING", "TcpRequestPlane"]
# MAX_REQUEST (v1_wire.py), 32 MiB, 1.x's DYN_TCP_MAX_MESSAGE_SIZE default, is the most one request may be: a
# request is a preprocessed prompt (token ids, sampling options), a few hundred kilobytes even for a
# 128k-token context, and NATS, the other request plane, refuses messages over 1 MiB by default; 32 MiB
# leaves room for large multimodal requests. Announcing more drops the connection before a byte of it is
# buffered.
# The most a worker holds, over all its connections, in requests whose end has not arrived yet. Clients send
# each request whole, so this is transient and small; without a fleet secret anyone who reaches the port
# could otherwise open a thousand connections and start a 32 MiB request on each. The connection that
# would take the total over it is dropped.
MAX_PENDING = 256 * 1024 * 1024


class TcpEndpoint:
    """One served endpoint; ``stop()`` makes its requests find no responder."""

    def __init__(self, plane: "TcpRequestPlane", path: str, address: str) -> None:
        self.plane = plane
        self.path = path
        self.address = address

    async def stop(self) -> None:
        self.plane.handlers.pop(self.path, None)


# ---------------------------------------------------------------------------------- client side


async def _acknowledged(fut: asyncio.Future[Any], deadline: float, address: str, timeout: float) -> Any:
    """The ack (or first frame) a request waits for, by ``deadline`` (the loop's clock)."""
    try:
        async with asyncio.timeout_at(deadline):
            return await fut
    except TimeoutError:
        raise TimeoutError(f"no acknowledgement from {address} within {timeout:g}s") from None


class ConnectionPool:
    """A client's connections, one per worker process (``host:port``), each dialed once however many
    requests wait for it: requests share a connection (acked in order), and a dial per request would cost
    a round trip (and a fleet-secret handshake) each."""

    def __init__(self, dial: Callable[[str], Awaitable[ClientConnection]]) -> None:
        self._dial = dial
        self._conns: dict[str, ClientConnection] = {}
        self._dialing: dict[str, asyncio.Future[ClientConnection]] = {}

    async def get(self, hostport: str, timeout: float) -> ClientConnection:
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

    async def _open(self, hostport: str) -> ClientConnection:
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
        self.server_conns: set[ServerConnection] = set()
        self.pending = 0  # bytes held in unfinished requests over all server connections (MAX_PENDING)
        self._server: Acceptor | None = None
        self._advertised = ""
        self._listening = asyncio.Lock()
        self._conns = ConnectionPool(self._dial)
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

    async def _dial(self, hostport: str) -> ClientConnection:
        host, port = split_address(hostport)
        try:
            conn = await dial(self.auth, hostport, host, port, lambda: ClientConnection(hostport), CALL_HOME_TIMEOUT,
                              "request plane")
        except (OSError, asyncio.TimeoutError, FleetAuthError) as exc:
            # refused: nobody listens there any more (the worker is gone), or it is not of this fleet
            # (another secret, or none: a Dynamo 1.x worker); as NATS's "no responders"
            raise NoResponders(f"{hostport}: {exc}") from None
        return cast(ClientConnection, conn)

    async def send(self, address: str, payload: bytes, timeout: float, state: StreamState | None = None) -> bytes:
        """``payload`` to the endpoint at ``address``; an empty payload is a ping (module docstring)."""
        if self._closed:
            raise RequestPlaneError("the request plane is closed")
        if not is_v1_tcp_address(address):
            if self.fallback is None:
                raise NoResponders(f"{address} is served over NATS and this process has no NATS request plane "
                                   "(start it with --request-plane nats, or the worker with --request-plane tcp)")
            return bytes(await self.fallback.send(address, payload, timeout, state))
        hostport, path = split_v1_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._conns.get(hostport, timeout)
        fut = loop.create_future()
        headers = {"x-endpoint-path": path}
        if state is not None:
            state.set_waiter(fut)  # the stream's first frame is as good as the ack (runtime/ack.py)
            headers["request-id"] = state.request_id
            if state.trace:  # the W3C trace context, in the message's headers as 1.x carries it
                headers.update(state.trace)
        conn.send(path, headers, payload, fut)
        try:
            result = await _acknowledged(fut, deadline, address, timeout)
        finally:
            if state is not None:
                state.clear_waiter(fut)
        return ack_result(result, address) if result else b""

    # ------------------------------------------------------------------ worker side

    async def _listen(self) -> None:
        async with self._listening:
            if self._server is not None:
                return
            bind = self.host or ANY_ADDRESS
            factory = guarded(self.auth, lambda: self._advertised,
                              lambda: ServerConnection(self, MAX_REQUEST, MAX_PENDING), "request plane")
            sock = await listen(bind, self.port)  # a fixed port is reused at once after a restart (SO_REUSEADDR)
            # our own accept loop, as the response streams': a burst of connections is accepted in one turn
            self._server = Acceptor(sock, factory, **tcp_tls.acceptor_options("request plane"))
            port = sock.getsockname()[1]
            host = self.advertise
            self._advertised = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            log.info("request plane: listening for requests on %s:%d (reached at %s)", bind, port,
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

    async def serve(self, service: str, endpoint: str, handler: RequestHandler, path: str = "") -> Any:
        """``path`` (``{instance_id:x}/{namespace}/{component}/{endpoint}``) names the endpoint on this
        process's port, and its address is ``host:port/<path>``."""
        if self.serving is not None:
            return await self.serving.serve(service, endpoint, handler, path)
        if not path:
            raise DynamoRuntimeError(f"serving {service}.{endpoint} over TCP needs its path "
                                     "({instance_id:x}/{namespace}/{component}/{endpoint})")
        if service not in self._services:
            await self.add_service(service)
        await self._listen()
        self.handlers[path] = handler
        return TcpEndpoint(self, path, f"{self._advertised}/{path}")

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
        if self.fallback is not None:
            await self.fallback.close()
