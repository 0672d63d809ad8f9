"""aiohttp imported through ``dynamo.frontend.http`` (its client side completed on first use, see
test_aiohttp_server.py): its client TLS contexts load CA certificates on first use, and verify exactly as
before (a server signed by a trusted CA is accepted, any other refused).

Each check runs in a fresh interpreter (the test process has imported aiohttp long before), against a
local https server with a certificate from a throw-away CA made with the openssl CLI; the CA is made
trusted the standard way, ``SSL_CERT_FILE``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import asyncio, ssl, sys
import dynamo.frontend.http  # imports aiohttp's server; its client, with CA loading deferred, on first use
import aiohttp
aiohttp.ClientSession  # the first use
import aiohttp.connector as conn
from aiohttp import web

assert "set_default_verify_paths" not in ssl.SSLContext.__dict__, "ssl.SSLContext left patched"
assert conn._SSL_CONTEXT_VERIFIED.__dict__.get("_ca_deferred"), "CA loading was not deferred"
later = ssl.create_default_context()
assert type(later) is ssl.SSLContext and later.cert_store_stats()["x509_ca"] > 0, "a later context was changed"

async def main():
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(sys.argv[1], sys.argv[2])
    app = web.Application()
    app.router.add_get("/", lambda r: web.Response(text="hello over tls"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as s:  # the default: aiohttp's verified context
            async with s.get(f"https://127.0.0.1:{port}/") as r:
                print("OK", await r.text())
    except aiohttp.ClientConnectorCertificateError as e:
        print("REFUSED", e)
    finally:
        await runner.cleanup()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("tls")
    ca_key, ca, key, csr, cert, ext = (d / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj", "/CN=test-ca")
    run("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return ca, cert, key


def _fetch(certs: tuple[Path, Path, Path], trusted: bool) -> str:
    ca, cert, key = certs
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if trusted:
        env["SSL_CERT_FILE"] = str(ca)
    else:
        env.pop("SSL_CERT_FILE", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(cert), str(key)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_deferred_ca_certificates_are_loaded_before_the_first_handshake(certs):
    assert _fetch(certs, trusted=True).startswith("OK hello over tls")


def test_a_server_from_an_untrusted_ca_is_still_refused(certs):
    out = _fetch(certs, trusted=False)
    assert out.startswith("REFUSED") and "certificate verify failed" in out, out
