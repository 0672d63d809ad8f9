"""What a stranger gets from a real worker's TCP request-plane port, with and without a fleet secret:
garbage, an HTTP request, a truncated request, requests for endpoints it does not serve (one with a payload
that is no request), and a flood of connections held open (some having sent half a request). Afterwards, and while
the flood is still held, the worker answers a fresh client (``fleet_peer.py ask``, a new process and a
new connection) and a chat request through the frontend; it logs the strangers in a few lines, not one
per connection.

The one-machine default (file store, TCP, ZMQ); ``ETCD_ENDPOINTS`` and ``NATS_SERVER`` emptied, skipped
when an etcd or NATS answers on the default ports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from dynamo.runtime.v1_wire import encode_request_message
from harness.fleet import NO_INFRA_ENV, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, cli_env
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

NS, COMP = "strangers", "backend"
ENDPOINT = f"dyn://{NS}.{COMP}.generate"
MODEL = "strangers"
SECRET = "the strangers test's secret, 32ch"
PEER = Path(__file__).with_name("fleet_peer.py")
UNSET = {**NO_INFRA_ENV, "DYN_TCP_RPC_HOST": "", "DYN_TCP_RPC_PORT": "", "DYN_FLEET_SECRET": "",
         "DYN_FLEET_SECRET_FILE": ""}
FLOOD = 300


@pytest.fixture(scope="module", params=[None, SECRET], ids=["no-secret", "secret"])
def fleet(request, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    env = {**UNSET, "DYN_FILE_KV": str(tmp_path_factory.mktemp("strangers") / "store")}
    if request.param:
        env["DYN_FLEET_SECRET"] = request.param
    worker = DynamoWorker(f"in={ENDPOINT}", "out=echo_core", str(tiny_model), "--model-name", MODEL, env=env).start()
    fe = None
    try:
        fe = DynamoRun("out=dyn", env=env).start()
        wait_for_model(fe, MODEL, ENDPOINT, 1)
        port = int(wait_until(lambda: re.search(r"request plane: listening for requests on 127\.0\.0\.1:(\d+)",
                                                worker.stderr_text()), 10, "the worker's port").group(1))
        yield {"worker": worker, "frontend": fe, "env": env, "port": port, "secret": request.param}
    finally:
        if fe is not None:
            fe.stop()
        worker.stop()


UNKNOWN = b"Server unavailable: unknown endpoint "  # 1.6.1's words: nothing is served under that path here


def exchange(port: int, data: bytes, *, read: bool = True, until: bytes | None = None) -> bytes:
    """Send ``data`` on a fresh connection; what the worker sends back until it closes, or until ``until``
    arrives; ``read=False``: close at once after sending."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data)
        if not read:
            return b""
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
                if until is not None and until in got:
                    break
        except ConnectionResetError:
            pass
        return got


def served(fleet: dict[str, Any]) -> None:
    """A fresh process on a fresh connection gets tokens, and the frontend answers a chat request."""
    done = subprocess.run([sys.executable, str(PEER), "ask", f"{NS}.{COMP}.generate"], env=cli_env(fleet["env"]),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] > 0 and not result["errors"], result
    r = httpx.post(fleet["frontend"].api_url + "/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_garbage_http_and_bad_frames_leave_the_worker_serving(fleet):
    port, secret = fleet["port"], fleet["secret"]
    garbage = exchange(port, os.urandom(4096))
    http = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    exchange(port, encode_request_message("0/a/b/c", {}, b"y" * 100)[:40], read=False)  # truncated
    # a request whose payload is no request, then one more, on one connection, for paths not served here
    unknown = exchange(port, encode_request_message("0/no/body/here", {}, b"\x00" * 10)
                       + encode_request_message("1/no/body/there", {}, b""), until=b"there")
    if secret:  # the worker spoke its hello, then closed: nothing of the plane was read
        for got in (garbage, http, unknown):
            assert got.startswith(b"\xffdynamo-") and len(got) == 48, got
    else:
        assert garbage == http == b""  # closed at once
        assert UNKNOWN + b"0/no/body/here" in unknown and UNKNOWN + b"1/no/body/there" in unknown
    served(fleet)
    assert fleet["worker"].running


def test_a_flood_of_connections_leaves_the_worker_serving(fleet):
    port, worker = fleet["port"], fleet["worker"]
    flood = []
    try:
        for i in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(encode_request_message("0/a/b/c", {}, b"x" * 64)[:20])  # half a request, then nothing
            flood.append(s)
        served(fleet)  # while every one of them is held open
    finally:
        for s in flood:
            s.close()
    served(fleet)
    assert worker.running
    # the strangers are named in a few lines, not one per connection
    lines = [x for x in worker.stderr_text().splitlines() if "request plane: " in x and "127.0.0.1:" in x
             and ("refused" in x or "garbage" in x or "undecodable" in x)]
    assert len(lines) <= 8, lines
