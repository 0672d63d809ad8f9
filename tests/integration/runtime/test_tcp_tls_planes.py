"""TLS on the TCP request plane and the response streams (Dynamo 1.x's ``DYN_TCP_TLS_*``), between runtimes in
this process on a file store of their own: requests and their streams cross in TLS with mutual certificates,
per stream and multiplexed, with and without the fleet secret inside; a plaintext stranger and a TLS dialer without a client certificate are refused at the listener in
one line each, and the listener keeps serving.

The settings are per process (as 1.x reads them), so every runtime here dials and serves in TLS; a fleet
whose processes disagree is tried with real processes (tests/e2e/test_tcp_tls_fleet.py)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest

from dynamo.cli.infra_secure import SecureFiles, prepare
from dynamo.runtime import DistributedRuntime, tcp_tls
from dynamo.runtime.tcp import split_address
from harness.wait import until

SECRET = b"integration fleet secret, 32 ch"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SecureFiles:
    return prepare(tmp_path_factory.mktemp("pki") / "infra", "127.0.0.1")


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch, pki: SecureFiles) -> SecureFiles:
    """Every runtime made here serves and dials in TLS, requiring and presenting client certificates."""
    for name in tcp_tls.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(tcp_tls.CERT, str(pki.server_cert))
    monkeypatch.setenv(tcp_tls.KEY, str(pki.server_key))
    monkeypatch.setenv(tcp_tls.CLIENT_CA, str(pki.ca))
    monkeypatch.setenv(tcp_tls.CA, str(pki.ca))
    monkeypatch.setenv(tcp_tls.CLIENT_CERT, str(pki.client_cert))
    monkeypatch.setenv(tcp_tls.CLIENT_KEY, str(pki.client_key))
    yield pki
    monkeypatch.undo()
    tcp_tls.reset()


@pytest.fixture
def make(tls_env: SecureFiles, file_runtimes: Callable[..., Awaitable[DistributedRuntime]]
         ) -> Callable[..., Awaitable[DistributedRuntime]]:
    """Runtimes reading DYN_TCP_TLS_* as a process does at start-up (after ``tls_env`` set them)."""
    return lambda secret=None, **overrides: file_runtimes(fleet_secret=secret, **overrides)


async def words(request: Any) -> AsyncIterator[dict[str, Any]]:
    for i in range(request["n"]):
        yield {"i": i, "word": "confidential-token"}


async def serving(rt: DistributedRuntime) -> asyncio.Task:
    ready = asyncio.Event()
    task = asyncio.create_task(rt.namespace("tls").component("c").endpoint("g").serve_endpoint(words, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    return task


async def client_of(rt: DistributedRuntime) -> Any:
    client = await rt.namespace("tls").component("c").endpoint("g").client()
    await client.wait_for_instances(10)
    return client


def address_of(client: Any) -> tuple[str, int]:
    """The worker's request-plane listener, from its instance record (``host:port/{id:x}/...``)."""
    [instance] = client.instances()
    return split_address(instance.subject.split("/")[0])


@pytest.mark.parametrize("secret", [None, SECRET], ids=["tls", "tls+fleet-secret"])
@pytest.mark.parametrize("mux", [True, False], ids=["multiplexed", "per-stream"])
async def test_requests_and_streams_cross_in_mutual_tls(make, mux, secret) -> None:
    worker = await make(secret, tcp_mux=mux)
    caller = await make(secret, tcp_mux=mux)
    task = await serving(worker)
    client = await client_of(caller)
    for n in (1, 4):
        assert [x["i"] async for x in client.generate({"n": n})] == list(range(n))
    task.cancel()


async def a_worker_and_its_client(make: Any, caplog: Any) -> tuple[asyncio.Task, Any, tuple[str, int]]:
    """A TLS worker serving, a TLS caller's client of it, the worker's listener address; TLS lines captured."""
    caplog.set_level(logging.WARNING, logger="dynamo.runtime.tcp_tls")
    task = await serving(await make())
    client = await client_of(await make())
    return task, client, address_of(client)


async def test_a_plaintext_peer_is_refused_at_the_listener_in_one_line(make, caplog) -> None:
    """What a 1.x process, or one of ours, without the DYN_TCP_TLS_* settings would do: speak its protocol
    in the clear. The listener says so in one line and keeps serving TLS peers."""
    task, client, (host, port) = await a_worker_and_its_client(make, caplog)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\x00\x00\x00\x10" + b"{}" * 8)  # a plaintext request frame
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered in the clear
    writer.close()
    await until(lambda: "request plane: TLS handshake with 127.0.0.1:" in caplog.text, 10, "the refusal line")
    line = next(r.getMessage() for r in caplog.records if "TLS handshake with" in r.getMessage())
    assert "plaintext peer" in line and "\n" not in line
    assert [x["i"] async for x in client.generate({"n": 2})] == [0, 1]
    task.cancel()


async def test_a_tls_dialer_without_a_client_certificate_is_refused(make, pki, caplog) -> None:
    task, client, (host, port) = await a_worker_and_its_client(make, caplog)
    anonymous = ssl.create_default_context(cafile=str(pki.ca))  # trusts the worker, presents nothing
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        reader, writer = await asyncio.open_connection(host, port, ssl=anonymous, server_hostname="127.0.0.1")
        writer.write(b"\x00" * 16)
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(1), 10)  # TLS 1.3: the refusal arrives after the handshake
    await until(lambda: "TLS handshake with 127.0.0.1:" in caplog.text, 10, "the refusal line")
    assert "certificate" in caplog.text
    assert [x["i"] async for x in client.generate({"n": 2})] == [0, 1]
    task.cancel()
