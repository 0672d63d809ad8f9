"""NATS's other credentials against a real nats-server over TLS (the token is tests/e2e/test_secure_infra.py's):
a user and password, and an nkey (``NATS_AUTH_NKEY``, a user seed that signs the server's nonce), each
working and each wrong one refused in one line naming what to check; TLS verified against the CA
``dynamo-run-infra --secure`` makes, with its client certificate."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Iterator

import nkeys
import pytest

from dynamo.cli.infra import nats_server_binary
from dynamo.cli.infra_secure import SecureFiles, prepare
from dynamo.runtime.config import NatsSettings
from dynamo.runtime.errors import RuntimeConnectionError
from dynamo.runtime.nats_conn import connect_nats
from harness.servers import free_port

USER, PASSWORD = "fleet", "the fleet's NATS password"


def user_seed() -> tuple[str, str]:
    """A fresh nkey user: (seed, public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(seed).public_key.decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SecureFiles, str]]:
    tmp = tmp_path_factory.mktemp("nats-auth")
    files = prepare(tmp / "infra", "127.0.0.1")
    seed, public = user_seed()
    port = free_port()
    conf = tmp / "nats.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\n'
        f'authorization {{\n  users = [\n    {{user: "{USER}", password: "{PASSWORD}"}}\n'
        f'    {{nkey: "{public}"}}\n  ]\n}}\n'
        f'tls {{\n  cert_file: "{files.server_cert}"\n  key_file: "{files.server_key}"\n'
        f'  ca_file: "{files.ca}"\n  verify: true\n}}\n')
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)
        yield f"tls://127.0.0.1:{port}", files, seed
    finally:
        proc.terminate()
        proc.wait(10)


def settings(url: str, files: SecureFiles, **auth: str) -> NatsSettings:
    return NatsSettings(server=url, tls_ca=str(files.ca), tls_cert=str(files.client_cert),
                        tls_key=str(files.client_key), **auth)


async def round_trip(s: NatsSettings) -> None:
    nc = await connect_nats(s)
    try:
        sub = await nc.subscribe("auth.test")
        await nc.publish("auth.test", b"hello")
        assert (await sub.next_msg(timeout=5)).data == b"hello"
    finally:
        await nc.close()


async def test_user_and_password(server):
    url, files, _ = server
    await round_trip(settings(url, files, username=USER, password=PASSWORD))
    with pytest.raises(RuntimeConnectionError, match=r"Authorization Violation.*check NATS_AUTH_\*"):
        await connect_nats(settings(url, files, username=USER, password="not it"))


async def test_an_nkey_signs_the_servers_nonce(server):
    url, files, seed = server
    await round_trip(settings(url, files, nkey_seed=seed))
    other, _ = user_seed()  # a valid seed the server does not know
    with pytest.raises(RuntimeConnectionError, match=r"Authorization Violation.*check NATS_AUTH_\*"):
        await connect_nats(settings(url, files, nkey_seed=other))


async def test_tls_needs_the_ca_and_the_client_certificate(server):
    url, files, _ = server
    with pytest.raises(RuntimeConnectionError, match="certificate verify failed.*NATS_TLS_CA_CERT_PATH"):
        await connect_nats(NatsSettings(server=url, username=USER, password=PASSWORD))
    with pytest.raises(RuntimeConnectionError, match="client certificate.*NATS_TLS_CLIENT_CERT_PATH"):
        await connect_nats(NatsSettings(server=url, tls_ca=str(files.ca), username=USER, password=PASSWORD))


def test_the_nkey_is_read_by_dynamos_name(monkeypatch) -> None:
    monkeypatch.setenv("NATS_AUTH_NKEY", "SUxyz")
    assert NatsSettings.from_env().nkey_seed == "SUxyz"
