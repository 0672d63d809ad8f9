"""This process's response streams, both sides: the receiver its requests' streams come back to (client
side) and the ways it opens a stream back to a client (worker side), by the transport each request names.

The client offers TCP call-home (default; multiplexed with ``DYN_TCP_MUX``) or, with
``DYN_RESPONSE_TRANSPORT=nats``, NATS subjects; a worker follows whatever the request's connection info
names. One :class:`ResponseStreams` per runtime, handed to its clients and endpoints, so that neither
needs the runtime itself.
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NatsClient

from .config import RuntimeSettings
from .context import Context
from .errors import DynamoRuntimeError
from .fleet_auth import FleetAuth
from .ingress import SinkOpener
from .mux import INFO_KEY as MUX_INFO_KEY
from .mux_callhome import MuxPool
from .nats_stream import TRANSPORT_NAME as NATS_TRANSPORT
from .nats_stream import NatsResponseReceiver, NatsSinkHub
from .tcp import TRANSPORT_NAME as TCP_TRANSPORT
from .tcp import ListenHosts
from .tcp_callhome import open_tcp_sink
from .tcp_listener import TcpResponseServer
from .transport import StreamState

Receiver = TcpResponseServer | NatsResponseReceiver


class ResponseStreams:
    def __init__(self, settings: RuntimeSettings, nc: NatsClient | None, hosts: ListenHosts | None = None,
                 auth: FleetAuth | None = None) -> None:
        self.settings = settings
        self.auth = auth  # the fleet secret's keys: TCP streams both ways are authenticated (None: no secret)
        self.hosts = hosts  # where the call-home listener binds and what it advertises (None: tcp_host)
        self._nc = nc
        self._receiver: Receiver | None = None
        self._nats_hub: NatsSinkHub | None = None
        self._mux_pool: MuxPool | None = None
        self._closed = False

    @property
    def started_receiver(self) -> Receiver | None:
        """The receiver if one was created (diagnostics, tests)."""
        return self._receiver

    @property
    def mux_pool(self) -> MuxPool | None:
        """The worker's multiplexed connections if any was opened (diagnostics, tests)."""
        return self._mux_pool

    def _nats(self) -> NatsClient:
        if self._nc is None:
            raise DynamoRuntimeError("NATS response streams need a NATS connection")
        return self._nc

    # ------------------------------------------------------------------ client side

    async def receiver(self) -> Receiver:
        """The receiver of this process's response streams (created on first use; kind per settings)."""
        if self._closed:
            raise DynamoRuntimeError("runtime is closed")
        receiver = self._receiver
        if receiver is None:
            if self.settings.response_transport == "nats":
                receiver = NatsResponseReceiver(self._nats(), self.settings.stream_liveness)
            else:
                hosts = self.hosts
                receiver = TcpResponseServer(hosts.advertise if hosts else self.settings.tcp_host,
                                             self.settings.stream_liveness, mux=self.settings.tcp_mux,
                                             bind=hosts.callhome if hosts else None, auth=self.auth,
                                             silence_1x=self.settings.stream_silence_1x)
            self._receiver = receiver
        if not receiver.address:
            await receiver.start()
        return receiver

    def on_instance_gone(self, states: list[StreamState]) -> None:
        """An instance's key vanished; ``states`` are its streams in flight."""
        if self._receiver is not None and states:
            self._receiver.on_instance_gone(states)

    # ------------------------------------------------------------------ worker side

    def sink_openers(self) -> dict[str, SinkOpener]:
        """How to open a response stream for each transport a client may ask for."""
        return {NATS_TRANSPORT: self._open_nats, TCP_TRANSPORT: self._open_tcp}

    async def _open_nats(self, transport: str, info: dict, context: Context) -> Any:
        if self._nats_hub is None:
            self._nats_hub = NatsSinkHub(self._nats())
        return await self._nats_hub.open(transport, info, context)

    async def _open_tcp(self, transport: str, info: dict, context: Context) -> Any:
        mux_id = info.get(MUX_INFO_KEY)
        if type(mux_id) is int and mux_id > 0 and self.settings.tcp_mux:  # the client offers multiplexing
            if self._mux_pool is None:
                self._mux_pool = MuxPool(self.auth)
            heartbeat_ms = info.get("heartbeat_ms")
            conn = await self._mux_pool.get(str(info["address"]),
                                            heartbeat_ms if type(heartbeat_ms) is int and heartbeat_ms > 0 else None)
            return conn.open(mux_id, context)
        return await open_tcp_sink(transport, info, context, self.auth)

    async def close(self) -> None:
        self._closed = True
        if self._receiver is not None:
            await self._receiver.close()
            self._receiver = None
        if self._nats_hub is not None:
            await self._nats_hub.close()
            self._nats_hub = None
        if self._mux_pool is not None:
            self._mux_pool.close()
            self._mux_pool = None
