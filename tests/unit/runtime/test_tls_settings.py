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
from dynamo.runtime.config import TCP_TLS_VARIABLES, NatsSettings, RuntimeSettings
from dynamo.runtime.errors import RuntimeConfigError
from dynamo.runtime.nats_conn import tls_context
from dynamo.runtime.tls import client_context

NAMES = ("CA_SETTING", "CERT_SETTING", "KEY_SETTING")


@pytest.mark.parametrize("name", TCP_TLS_VARIABLES)
def test_dynamo_1x_tcp_tls_is_refused_in_one_line_naming_it(monkeypatch, name: str):
    """1.x's TLS on the TCP planes is not implemented here: a process asked for it does not run in plaintext."""
    for other in TCP_TLS_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "/etc/dynamo/tls.pem")
    with pytest.raises(RuntimeConfigError) as e:
        RuntimeSettings.from_env()
    assert str(e.value).startswith(f"{name} is set") and "\n" not in str(e.value)


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
