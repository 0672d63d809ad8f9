"""``dynamo-run-infra --secure``: etcd and NATS locked as their operators lock them, generated on first use.

Into the data folder (0700; every key, password and token file 0600) go a private CA, a server certificate
for both servers and a client certificate for the fleet's processes, an etcd user with a random password,
a NATS token, and a fleet secret for the TCP and ZMQ planes. ``secure.env`` holds every setting the other
processes need, under the names Dynamo 1.x reads (ETCD_AUTH_*, NATS_AUTH_TOKEN, NATS_TLS_*), so one
``set -a; . secure.env; set +a`` per terminal is the whole set-up. Kept across restarts: etcd's users live
in its data, and a worker started yesterday keeps working with today's servers; ``--fresh`` makes new ones.

Both servers require TLS with a client certificate signed by the CA *and* a credential (etcd's password,
NATS's token), so a stolen certificate alone, or a leaked password alone, gets nothing. The certificates use
P-256 keys and are made with the ``cryptography`` package (the ``infra`` extra), not the openssl command,
so they come out the same wherever Python runs.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import secrets
import shlex
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SecureFiles", "prepare", "etcd_tls_args", "nats_config", "enable_etcd_auth", "advertised_host", "write_env"]

ETCD_USER = "dynamo"
CERT_DAYS = 825  # the most a TLS client accepts from a private CA on some platforms
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(slots=True)
class SecureFiles:
    """Where --secure keeps what it generated, and the credentials themselves."""

    root: Path
    etcd_password: str
    root_password: str
    nats_token: str
    fleet_secret: str

    @property
    def ca(self) -> Path:
        return self.root / "tls" / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "tls" / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "tls" / "server-key.pem"

    @property
    def client_cert(self) -> Path:
        return self.root / "tls" / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.root / "tls" / "client-key.pem"

    @property
    def env_file(self) -> Path:
        return self.root / "secure.env"

    @property
    def nats_conf(self) -> Path:
        return self.root / "nats-secure.conf"

    @property
    def etcd_auth_marker(self) -> Path:
        return self.root / "etcd" / "dynamo-auth-enabled"

    def environment(self, etcd_url: str, nats_url: str) -> dict[str, str]:
        """The settings every process of the fleet needs, by the names it reads them."""
        return {
            "ETCD_ENDPOINTS": etcd_url,
            "ETCD_AUTH_USERNAME": ETCD_USER,
            "ETCD_AUTH_PASSWORD": self.etcd_password,
            "ETCD_AUTH_CA": str(self.ca),
            "ETCD_AUTH_CLIENT_CERT": str(self.client_cert),
            "ETCD_AUTH_CLIENT_KEY": str(self.client_key),
            "NATS_SERVER": nats_url,
            "NATS_AUTH_TOKEN": self.nats_token,
            "NATS_TLS_CA_CERT_PATH": str(self.ca),
            "NATS_TLS_CLIENT_CERT_PATH": str(self.client_cert),
            "NATS_TLS_CLIENT_KEY_PATH": str(self.client_key),
            "DYN_FLEET_SECRET": self.fleet_secret,
        }


def advertised_host(host: str) -> str:
    """The name clients dial: the host name when the servers listen on every interface."""
    return socket.gethostname() if host in WILDCARDS else host


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner alone (never briefly wider: the mode is set at creation)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _secret_file(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_hex(24)
    _write_private(path, value.encode() + b"\n")
    return value


def prepare(root: Path, host: str) -> SecureFiles:
    """Generate (first time) or load (later) the certificates and credentials under ``root``."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    creds = root / "credentials"
    files = SecureFiles(root=root, etcd_password=_secret_file(creds / "etcd-dynamo-password"),
                        root_password=_secret_file(creds / "etcd-root-password"),
                        nats_token=_secret_file(creds / "nats-token"),
                        fleet_secret=_secret_file(creds / "fleet-secret"))
    made_for = root / "tls" / "host"
    if files.ca.exists() and files.server_cert.exists() and files.client_cert.exists():
        before = made_for.read_text().strip() if made_for.exists() else host
        if before != host:
            raise ValueError(f"the certificates in {root / 'tls'} were made for --host {before}, not {host}: "
                             "start with the same --host, or add --fresh (new certificates and credentials, "
                             "to be given to every process again)")
    else:
        _make_certificates(files, host)
        made_for.write_text(host + "\n")
    return files


def _make_certificates(files: SecureFiles, host: str) -> None:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise FileNotFoundError("--secure makes its certificates with the cryptography package: "
                                "pip install '.[infra]' from the checkout") from None

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def name(cn: str) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dynamo-run-infra")]
        if cn:
            attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"dynamo-run-infra CA {secrets.token_hex(4)}")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))

    def issue(cn: str, usages: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    dns, ips = _server_names(host)
    # Neither certificate has a common name: with client certificates on, etcd refuses every JSON-gateway
    # request whose client certificate carries one ("CommonName of client sending a request against gateway
    # will be ignored"), and a certificate without one never stands for an etcd user by itself. The server's
    # serves as a client too: etcd's gateway dials etcd's own gRPC port with it.
    server_pem, server_key = issue("", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                                   [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips])
    client_pem, client_key = issue("", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    _write_private(files.root / "tls" / "ca-key.pem", key_pem(ca_key))
    _write_private(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write_private(files.server_key, server_key)
    _write_private(files.server_cert, server_pem)
    _write_private(files.client_key, client_key)
    _write_private(files.client_cert, client_pem)


def _server_names(host: str) -> tuple[list[str], list[str]]:
    """The names and addresses the server certificate covers: loopback, the host asked for, and with a
    wildcard host the machine's name and its addresses."""
    dns = {"localhost"}
    ips = {"127.0.0.1", "::1"}
    names = [host] if host not in WILDCARDS else [socket.gethostname(), socket.getfqdn()]
    if host in WILDCARDS:
        try:
            ips.update(str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
        except OSError:
            pass
    for n in names:
        try:
            ips.add(str(ipaddress.ip_address(n)))
        except ValueError:
            dns.add(n)
    return sorted(dns), sorted(ips)


def etcd_tls_args(files: SecureFiles) -> list[str]:
    """etcd's flags for TLS with client certificates on both its client and its peer port."""
    return ["--cert-file", str(files.server_cert), "--key-file", str(files.server_key),
            "--trusted-ca-file", str(files.ca), "--client-cert-auth",
            "--peer-cert-file", str(files.server_cert), "--peer-key-file", str(files.server_key),
            "--peer-trusted-ca-file", str(files.ca), "--peer-client-cert-auth"]


def nats_config(files: SecureFiles) -> Path:
    """A nats-server config with the token and TLS that requires a client certificate from the CA."""
    def q(p: Path | str) -> str:
        return '"' + str(p).replace("\\", "\\\\").replace('"', '\\"') + '"'

    text = (f"authorization {{\n  token: {q(files.nats_token)}\n}}\n"
            f"tls {{\n  cert_file: {q(files.server_cert)}\n  key_file: {q(files.server_key)}\n"
            f"  ca_file: {q(files.ca)}\n  verify: true\n  timeout: 2\n}}\n")
    _write_private(files.nats_conf, text.encode())
    return files.nats_conf


def enable_etcd_auth(files: SecureFiles, endpoint: str) -> None:
    """Create etcd's root and fleet users and turn authentication on, once per data folder.

    The fleet's user gets read-write on every key through its own role rather than the root role, so the
    fleet's password cannot change etcd's users or turn authentication off. Done over etcd's JSON gateway
    with the fleet's client certificate (before authentication is on, any client may manage users).
    """
    if files.etcd_auth_marker.exists():
        return
    ctx = ssl.create_default_context(cafile=str(files.ca))
    ctx.load_cert_chain(str(files.client_cert), str(files.client_key))
    everything = base64.b64encode(b"\0").decode()  # key "\0" to range end "\0": every key
    steps: list[tuple[str, dict]] = [
        ("/v3/auth/user/add", {"name": "root", "password": files.root_password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/user/add", {"name": ETCD_USER, "password": files.etcd_password}),
        ("/v3/auth/role/add", {"name": ETCD_USER}),
        ("/v3/auth/role/grant", {"name": ETCD_USER,
                                 "perm": {"permType": "READWRITE", "key": everything, "range_end": everything}}),
        ("/v3/auth/user/grant", {"user": ETCD_USER, "role": ETCD_USER}),
        ("/v3/auth/enable", {}),
    ]
    for path, body in steps:
        request = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            if "already exists" not in text:
                raise RuntimeError(f"etcd {path}: {exc.code} {text.strip()[:200]}") from None
    files.etcd_auth_marker.write_text("authentication enabled by dynamo-run-infra --secure\n")


def write_env(files: SecureFiles, env: dict[str, str]) -> None:
    """``secure.env``: the fleet's settings, one ``NAME=value`` a line, for ``set -a; . secure.env``."""
    lines = [f"{k}={_shell_quote(v)}" for k, v in env.items()]
    _write_private(files.env_file, ("\n".join(lines) + "\n").encode())


def _shell_quote(value: str) -> str:
    return shlex.quote(value)
