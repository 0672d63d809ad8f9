"""The harness starts servers without a port race: a port another process takes between the harness's
pick and the server's bind does not fail the test (a fresh suite run once did: "address already in use").

Each test takes the port first, on purpose, the way a concurrent process would."""

from __future__ import annotations

import socket

import httpx

from harness.proc import DynamoRun
from harness.servers import EtcdServer, NatsServer


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_etcd_picks_another_client_port_when_its_pick_was_taken():
    etcd = EtcdServer()
    taken = etcd.client_port
    with _hold(taken), etcd:
        assert etcd.client_port != taken
        assert httpx.get(etcd.url + "/health", timeout=5).json()["health"] == "true"


def test_nats_and_the_frontend_bind_port_0_and_report_the_port_they_got():
    with NatsServer() as nats, DynamoRun("out=echo_full", "--model-name", "echo") as frontend:
        assert nats.port > 0 and frontend.port > 0
        with socket.create_connection(("127.0.0.1", nats.port), timeout=5) as s:
            assert s.recv(4) == b"INFO"
        assert httpx.get(frontend.api_url + "/models", timeout=5).json()["data"][0]["id"] == "echo"


def test_a_restarted_nats_comes_back_on_the_port_its_clients_know():
    with NatsServer() as nats:
        first = nats.port
        nats.restart()
        assert nats.port == first
        with socket.create_connection(("127.0.0.1", first), timeout=5) as s:
            assert s.recv(4) == b"INFO"
