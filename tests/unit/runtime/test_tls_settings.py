"""TLS settings of the etcd and NATS clients: Dynamo 1.x's names, and a clear error for each mistake before
any connection is tried; and the certificates ``dynamo-run-infra --secure`` makes verify each other over a
real TLS handshake."""

from __future__ import annotations

import asyncio
import ssl
import stat
from pathlib import Path

import pytest

from dynamo.cli.infra_secure import prepare
from dynamo.runtime import tcp_tls
from dynamo.runtime.config import NatsSettings, RuntimeSettings
from dynamo.runtime.errors import RuntimeConfigError
from dynamo.runtime.nats_conn import tls_context
from dynamo.runtime.tls import client_context

NAMES = ("CA_SETTING", "CERT_SETTING", "KEY_SETTING")


def tcp_tls_env(monkeypatch, **values: str) -> None:
    for name in tcp_tls.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(getattr(tcp_tls, name), value)


@pytest.mark.parametrize(("given", "names"), [
    ({"CERT": "c.pem"}, ("DYN_TCP_TLS_CERT_PATH", "DYN_TCP_TLS_KEY_PATH")),
    ({"CLIENT_CA": "ca.pem"}, ("DYN_TCP_TLS_CLIENT_CA_CERT_PATH", "DYN_TCP_TLS_CERT_PATH")),
    ({"CLIENT_CERT": "c.pem"}, ("DYN_TCP_TLS_CLIENT_CERT_PATH", "DYN_TCP_TLS_CLIENT_KEY_PATH")),
    ({"CLIENT_CERT": "c.pem", "CLIENT_KEY": "k.pem"}, ("DYN_TCP_TLS_CA_CERT_PATH", "DYN_TCP_TLS_INSECURE")),
    ({"CA": "/nowhere/ca.pem"}, ("DYN_TCP_TLS_CA_CERT_PATH=/nowhere/ca.pem: no such file",)),
    ({"CERT": "/nowhere/c.pem", "KEY": "/nowhere/k.pem"}, ("/nowhere/c.pem: no such file",)),
    ({"HANDSHAKE_TIMEOUT": "soon"}, ("DYN_TCP_TLS_HANDSHAKE_TIMEOUT_SECS='soon'",)),
], ids=["cert-without-key", "client-ca-without-server-tls", "client-cert-without-key", "client-cert-without-ca",
        "missing-ca", "missing-cert", "bad-timeout"])
def test_a_dynamo_1x_tcp_tls_setting_that_cannot_work_stops_start_up_in_one_line(monkeypatch, given, names):
    """1.x's DYN_TCP_TLS_* are read by our runtime: a setting that cannot work is one line at start-up naming
    it, never a plaintext process where TLS was asked for."""
    tcp_tls_env(monkeypatch, **given)
    with pytest.raises(RuntimeConfigError) as e:
        RuntimeSettings.from_env()
    assert all(name in str(e.value) for name in names) and "\n" not in str(e.value), str(e.value)


def test_dynamo_1x_tcp_tls_roles_follow_their_variables(monkeypatch, tmp_path: Path):
    files = prepare(tmp_path / "infra", "127.0.0.1")
    tcp_tls_env(monkeypatch)
    assert tcp_tls.from_env() == tcp_tls.PLAIN and tcp_tls.PLAIN.dial_options("10.0.0.2") == {}
    tcp_tls_env(monkeypatch, CERT=str(files.server_cert), KEY=str(files.server_key))  # serves, dials plain
    tls = tcp_tls.from_env()
    assert tls.server is not None and tls.client is None and not tls.mutual
    tcp_tls_env(monkeypatch, CERT=str(files.server_cert), KEY=str(files.server_key), CLIENT_CA=str(files.ca),
                CA=str(files.ca), CLIENT_CERT=str(files.client_cert), CLIENT_KEY=str(files.client_key),
                SERVER_NAME="worker.internal", HANDSHAKE_TIMEOUT="7")
    tls = tcp_tls.from_env()
    assert tls.mutual and tls.server is not None and tls.server.verify_mode == ssl.CERT_REQUIRED
    assert tls.dial_options("10.0.0.2") == {"ssl": tls.client, "server_hostname": "worker.internal",
                                            "ssl_handshake_timeout": 7.0}
    assert tls.describe() == "TLS on the TCP planes: serving mutual, dialing on"
    tcp_tls_env(monkeypatch, INSECURE="true")
    tls = tcp_tls.from_env()
    assert tls.client is not None and tls.client.verify_mode == ssl.CERT_NONE
    assert tls.dial_options("10.0.0.2")["server_hostname"] == "10.0.0.2"


def test_nats_tls_settings_read_by_dynamo_names(monkeypatch):
    monkeypatch.setenv("NATS_SERVER", "tls://nats.example:4222")
    monkeypatch.setenv("NATS_TLS_CA_CERT_PATH", "/ca.pem")
    monkeypatch.setenv("NATS_TLS_CLIENT_CERT_PATH", "/c.pem")
    monkeypatch.setenv("NATS_TLS_CLIENT_KEY_PATH", "/k.pem")
    monkeypatch.setenv("NATS_TLS_INSECURE", "true")
    s = NatsSettings.from_env()
    assert (s.tls_ca, s.tls_cert, s.tls_key, s.tls_insecure) == ("/ca.pem", "/c.pem", "/k.pem", True)
    monkeypatch.setenv("NATS_TLS_INSECURE", "maybe")
    with pytest.raises(RuntimeConfigError, match="NATS_TLS_INSECURE"):
        NatsSettings.from_env()


def test_nats_tls_settings_need_a_tls_url():
    with pytest.raises(RuntimeConfigError, match="not a tls:// URL"):
        tls_context(NatsSettings(server="nats://127.0.0.1:4222", tls_ca="/ca.pem"))
    assert tls_context(NatsSettings(server="nats://127.0.0.1:4222")) is None
    # tls:// alone: the system's trust store, verified
    ctx = tls_context(NatsSettings(server="tls://127.0.0.1:4222"))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    insecure = tls_context(NatsSettings(server="tls://127.0.0.1:4222", tls_insecure=True))
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE


def test_each_bad_file_is_named(tmp_path):
    with pytest.raises(RuntimeConfigError, match=r"^CA_SETTING=/no/ca.pem: no such file$"):
        client_context(ca="/no/ca.pem", cert=None, key=None, names=NAMES)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(RuntimeConfigError, match="CA_SETTING=.*not a readable PEM CA certificate"):
        client_context(ca=str(garbage), cert=None, key=None, names=NAMES)
    with pytest.raises(RuntimeConfigError, match="KEY_SETTING is set without CERT_SETTING"):
        client_context(ca=None, cert=None, key=str(garbage), names=NAMES)
    with pytest.raises(RuntimeConfigError, match="CERT_SETTING=.*not a matching PEM certificate and key"):
        client_context(ca=None, cert=str(garbage), key=str(garbage), names=NAMES)


async def test_the_infra_certificates_make_a_mutual_tls_handshake(tmp_path):
    files = prepare(tmp_path / "infra", "127.0.0.1")
    for secret in [*(files.root / "tls").glob("*key.pem"), *(files.root / "credentials").iterdir()]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert stat.S_IMODE(files.root.stat().st_mode) == 0o700
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files.ca))
    server_ctx.load_cert_chain(str(files.server_cert), str(files.server_key))
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen: list[object] = []

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("peercert"))
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        client_ctx = client_context(ca=str(files.ca), cert=str(files.client_cert), key=str(files.client_key),
                                    names=NAMES)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        writer.close()
        assert seen and seen[0]  # the server saw a verified client certificate
        # without the client certificate the server refuses the handshake
        bare = client_context(ca=str(files.ca), cert=None, key=None, names=NAMES)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=bare)
            writer.write(b"hello\n")
            echoed = await reader.readline()  # TLS 1.3: the refusal arrives after the client's handshake
        except (ssl.SSLError, ConnectionError):
            echoed = b""
        assert echoed == b"" and len(seen) == 1
    finally:
        server.close()
        await server.wait_closed()
    # a second start finds and keeps what the first made
    again = prepare(tmp_path / "infra", "127.0.0.1")
    assert again.etcd_password == files.etcd_password and again.ca.read_bytes() == files.ca.read_bytes()


def test_prepare_refuses_nothing_but_makes_its_folder_private(tmp_path: Path):
    root = tmp_path / "wide"
    root.mkdir(mode=0o755)
    prepare(root, "localhost")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_certificates_made_for_another_host_are_refused_in_one_line(tmp_path: Path):
    prepare(tmp_path / "infra", "127.0.0.1")
    with pytest.raises(ValueError, match=r"made for --host 127\.0\.0\.1, not 10\.1\.2\.3: .*--fresh"):
        prepare(tmp_path / "infra", "10.1.2.3")
