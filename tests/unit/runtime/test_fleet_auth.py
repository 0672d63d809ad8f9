"""The fleet secret's handshake byte by byte (both sides' proofs, another secret, another address, no
handshake at all, a reflected hello, any split of the bytes), the secret's settings (a file only its owner
may read), and the handshake on real loopback sockets in front of the TCP request plane: a client with
the secret gets its answer, one with another secret or none gets nothing and the worker keeps serving."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from dynamo.runtime.errors import RuntimeConfigError
from dynamo.runtime.fleet_auth import (
    DIALER,
    HELLO_LEN,
    LISTENER,
    MAGIC,
    PROOF_LEN,
    FleetAuth,
    FleetAuthError,
    is_fleet_hello,
    load_secret,
)
from dynamo.runtime.request_plane import NoResponders
from dynamo.runtime.tcp_request_plane import TcpRequestPlane
from harness.wait import until

SECRET = b"correct horse battery staple"
OTHER = b"another fleet's secret 1234"
ADDRESS = "127.0.0.1:4000"


def run(dialer, listener, *, split: int = 0) -> tuple[bytes, bytes]:
    """Exchange the two sides' bytes until neither has more to say; ``split``: feed in pieces of this size.
    Returns what is left over after each side's handshake (its first plane bytes)."""
    to_listener, to_dialer = dialer.hello, listener.hello
    rest_d = rest_l = b""
    for _ in range(4):
        if not to_listener and not to_dialer:
            break
        out_l, out_d = b"", b""
        for chunk in pieces(to_listener, split):
            out, rest = listener.feed(chunk)
            out_l += out
            rest_l += rest
        for chunk in pieces(to_dialer, split):
            out, rest = dialer.feed(chunk)
            out_d += out
            rest_d += rest
        to_listener, to_dialer = out_d, out_l
    return rest_d, rest_l


def pieces(data: bytes, size: int) -> list[bytes]:
    if not size:
        return [data] if data else []
    return [data[i:i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("split", [0, 1, 7, HELLO_LEN])
def test_the_same_secret_proves_both_sides(split: int) -> None:
    dialer = FleetAuth(SECRET).handshake(DIALER, ADDRESS)
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    run(dialer, listener, split=split)
    assert dialer.done and listener.done
    assert len(dialer.hello) == HELLO_LEN and is_fleet_hello(dialer.hello)
    assert SECRET not in dialer.hello + listener.hello  # never on the wire


def test_bytes_after_the_proof_are_the_planes() -> None:
    dialer = FleetAuth(SECRET).handshake(DIALER, ADDRESS)
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    listener.feed(dialer.hello)
    proof, _ = dialer.feed(listener.hello)
    out, rest = listener.feed(proof + b"first request")
    assert listener.done and out == b"" and rest == b"first request"
    assert listener.feed(b"more") == (b"", b"more")


def test_another_secret_is_refused_by_both_sides() -> None:
    dialer = FleetAuth(OTHER).handshake(DIALER, ADDRESS)
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    proof_l, _ = listener.feed(dialer.hello)
    with pytest.raises(FleetAuthError, match="another DYN_FLEET_SECRET") as refused:
        dialer.feed(listener.hello + proof_l)
    assert len(refused.value.reply) == PROOF_LEN  # still sent, so the listener says why too
    with pytest.raises(FleetAuthError, match="another DYN_FLEET_SECRET"):
        listener.feed(refused.value.reply)
    assert not dialer.done and not listener.done


def test_a_proof_is_bound_to_the_address_dialed() -> None:
    """An impostor registered at its own address cannot relay a real worker's proof: the worker proves
    itself for its own address."""
    dialer = FleetAuth(SECRET).handshake(DIALER, "10.0.0.9:5000")  # the impostor's record
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)  # the real worker, relayed to
    proof_l, _ = listener.feed(dialer.hello)
    with pytest.raises(FleetAuthError):
        dialer.feed(listener.hello + proof_l)


def test_a_proof_is_not_valid_for_the_other_role() -> None:
    """A listener's hello and proof reflected back at it (its own nonce) are refused."""
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    with pytest.raises(FleetAuthError, match="own nonce"):
        listener.feed(listener.hello)
    # and a dialer's proof is not a listener's: a second listener fed a dialer's proof as its peer's
    a = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    b = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    proof_a, _ = a.feed(b.hello)
    with pytest.raises(FleetAuthError):
        b.feed(a.hello + proof_a)


@pytest.mark.parametrize("first", [b"\x00" * 16 + b"\x00" * 40, b"GET / HTTP/1.1\r\n", b"\xffdyn"])
def test_a_peer_without_the_handshake_is_refused_at_its_first_bytes(first: bytes) -> None:
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    if MAGIC.startswith(first):
        assert listener.feed(first) == (b"", b"")  # a prefix of the hello: wait for the rest
        with pytest.raises(FleetAuthError, match="did not start"):
            listener.feed(b"X" * HELLO_LEN)
    else:
        with pytest.raises(FleetAuthError, match="did not start the fleet-secret handshake"):
            listener.feed(first)


def test_a_dynamo_1x_request_is_named_in_the_refusal() -> None:
    """A 1.x frontend has no fleet secret: the one line a worker that requires it logs names it (or one of ours
    without the secret: the wire is the same)."""
    path = b"59f5a0430fd477b0/d16/backend/generate"
    listener = FleetAuth(SECRET).handshake(LISTENER, ADDRESS)
    with pytest.raises(FleetAuthError, match="a request without the fleet-secret handshake .*a Dynamo 1.x frontend"):
        listener.feed(len(path).to_bytes(2, "big") + path + b"\x00\x10")


def test_the_derived_keys_depend_on_the_secret_only() -> None:
    assert FleetAuth(SECRET).derive("x") == FleetAuth(SECRET).derive("x") != FleetAuth(OTHER).derive("x")
    assert FleetAuth(SECRET).derive("x") != FleetAuth(SECRET).derive("y")
    assert "horse" not in repr(FleetAuth(SECRET))


def test_the_secret_from_the_environment() -> None:
    assert load_secret({}) is None
    assert load_secret({"DYN_FLEET_SECRET": " " + SECRET.decode() + "\n"}) == SECRET
    with pytest.raises(RuntimeConfigError, match="at least 16"):
        load_secret({"DYN_FLEET_SECRET": "short"})


def test_the_secret_file_must_be_its_owners_alone(tmp_path) -> None:
    path = tmp_path / "fleet.secret"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o600)
    assert load_secret({"DYN_FLEET_SECRET_FILE": str(path)}) == SECRET
    os.chmod(path, 0o640)
    with pytest.raises(RuntimeConfigError) as refused:
        load_secret({"DYN_FLEET_SECRET_FILE": str(path)})
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and f"chmod 600 {path}" in message and "0640" in message
    with pytest.raises(RuntimeConfigError, match="cannot read"):
        load_secret({"DYN_FLEET_SECRET_FILE": str(tmp_path / "absent")})
    with pytest.raises(RuntimeConfigError, match="not both"):
        load_secret({"DYN_FLEET_SECRET_FILE": str(path), "DYN_FLEET_SECRET": SECRET.decode()})


# ---------------------------------------------------------------------------------- on real sockets


PATH = "1/ns/svc/gen"
SERVED: list[bytes] = []


async def echo(request) -> None:
    SERVED.append(request.data)
    await request.respond(b"")  # taken


@pytest.fixture
async def worker():
    SERVED.clear()
    plane = TcpRequestPlane("127.0.0.1", auth=FleetAuth(SECRET))
    endpoint = await plane.serve("svc", "gen", echo, PATH)
    yield plane, endpoint.address
    await plane.close()


async def test_a_client_with_the_secret_is_answered(worker) -> None:
    _, address = worker
    client = TcpRequestPlane(auth=FleetAuth(SECRET))
    try:
        assert await client.send(address, b"hello", 5) == b""
        assert await client.send(address, b"again", 5) == b""  # the same connection
        assert SERVED == [b"hello", b"again"]
    finally:
        await client.close()


@pytest.mark.parametrize("secret", [OTHER, None], ids=["another-secret", "no-secret"])
async def test_a_client_without_the_secret_gets_nothing_and_the_worker_keeps_serving(worker, secret, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    plane, address = worker
    served = []

    async def record(request) -> None:
        served.append(request.data)
        await request.respond(b"")

    plane.handlers[PATH] = record
    stranger = TcpRequestPlane(auth=FleetAuth(secret) if secret else None)
    try:
        with pytest.raises(NoResponders):
            await stranger.send(address, b"steal", 5)
    finally:
        await stranger.close()
    assert served == []

    def lines() -> list[str]:  # every level: a repeat within the minute is logged at debug level
        return [r.getMessage() for r in caplog.records]

    await until(lambda: any(x.startswith("request plane: refused a connection from 127.0.0.1:") for x in lines()), 5,
                "the worker's line about the stranger")
    if secret:
        hostport = address.split("/")[0]
        assert any(f"request plane: {hostport} failed the fleet-secret check" in x for x in lines()), lines()
    else:
        assert any("requires a fleet secret and this process has none" in x for x in lines()), lines()
    plane.handlers[PATH] = echo
    client = TcpRequestPlane(auth=FleetAuth(SECRET))
    try:
        assert await client.send(address, b"still", 5) == b"" and SERVED == [b"still"]
    finally:
        await client.close()


async def test_a_silent_connection_is_dropped_after_the_handshake_timeout(worker, monkeypatch) -> None:
    import dynamo.runtime.fleet_auth as fleet_auth

    monkeypatch.setattr(fleet_auth, "HANDSHAKE_TIMEOUT", 0.2)
    plane, address = worker
    host, port = address.split("/")[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    hello = await reader.readexactly(HELLO_LEN)  # the worker speaks first, then waits for ours
    assert is_fleet_hello(hello)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the worker
    writer.close()


async def test_a_worker_without_the_secret_names_why_it_refuses_a_keyed_client(caplog) -> None:
    """The keyed client's hello would read as a request path of some 65,000 bytes; the worker says instead
    that its peer has a fleet secret and it has none, and the client finds no responder there."""
    caplog.set_level(logging.DEBUG)
    plain = TcpRequestPlane("127.0.0.1")
    endpoint = await plain.serve("svc", "gen", echo, PATH)
    keyed = TcpRequestPlane(auth=FleetAuth(SECRET))
    try:
        with pytest.raises(NoResponders):
            await keyed.send(endpoint.address, b"hello", 5)
    finally:
        await keyed.close()
        await plain.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request plane: refused")]
    assert lines and lines[0].endswith("it authenticates with a fleet secret and this process has none "
                                       "(set DYN_FLEET_SECRET)"), [r.getMessage() for r in caplog.records]
