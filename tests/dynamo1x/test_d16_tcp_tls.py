"""A mixed fleet secured the way Dynamo 1.6.1 secures its TCP planes: ``DYN_TCP_TLS_*`` on every process, with
mutual certificates, real processes of both kinds on one file store.

Both ways: 1.6.1's frontend sends requests to our worker's TLS listener and our worker calls home to the
frontend's TLS listener; our frontend does the same with 1.6.1's mocker. And a fleet whose halves disagree
(our worker in TLS, 1.6.1's frontend in the clear) fails the request with an error, not a hang, and our worker
says why in one line.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from dynamo.cli.infra_secure import SecureFiles, prepare
from harness.dynamo1x import d16_env, d16_frontend, d16_mocker
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

from .test_d16_serving import chat, wait_listed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SecureFiles:
    return prepare(tmp_path_factory.mktemp("pki") / "infra", "127.0.0.1")


def mutual_tls(pki: SecureFiles) -> dict[str, str]:
    """What 1.x's docs tell an operator to set on every process: serve with a certificate and require the
    peers', dial verifying theirs and presenting one."""
    return {"DYN_TCP_TLS_CERT_PATH": str(pki.server_cert), "DYN_TCP_TLS_KEY_PATH": str(pki.server_key),
            "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": str(pki.ca), "DYN_TCP_TLS_CA_CERT_PATH": str(pki.ca),
            "DYN_TCP_TLS_CLIENT_CERT_PATH": str(pki.client_cert),
            "DYN_TCP_TLS_CLIENT_KEY_PATH": str(pki.client_key)}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_d16_frontend_serves_our_worker_over_mutual_tls(tiny_chat_5k: Path, store: Path, pki: SecureFiles,
                                                        stream: bool) -> None:
    theirs = dict(d16_env(store), **mutual_tls(pki))
    ours = dict(theirs, PYTHONPATH=SRC)
    with DynamoWorker("in=dyn://tls.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "our-mock",
                      env=ours, startup_timeout=60) as worker, d16_frontend(theirs, model="our-mock") as frontend:
        text, usage, finish = chat(frontend.url, "our-mock", 5, stream)
        assert usage["completion_tokens"] == 5 and finish == "length", (text, usage)
        assert "serving mutual, dialing on" in worker.stderr_text()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_our_frontend_serves_d16_mocker_over_mutual_tls(tiny_chat_5k: Path, store: Path, pki: SecureFiles,
                                                        stream: bool) -> None:
    theirs = dict(d16_env(store), **mutual_tls(pki))
    ours = dict(theirs, PYTHONPATH=SRC)
    with d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", theirs, "--speedup-ratio", "0",
                    model_name="m16-model", store=store), DynamoRun("out=dyn", env=ours, startup_timeout=60) as frontend:
        wait_listed(frontend.base_url, "m16-model")
        text, usage, finish = chat(frontend.base_url, "m16-model", 6, stream)
        assert text.count(" w") == 6 and usage["completion_tokens"] == 6 and finish == "length", text


def test_a_plaintext_d16_frontend_fails_against_our_tls_worker_in_one_line(tiny_chat_5k: Path, store: Path,
                                                                          pki: SecureFiles) -> None:
    theirs = d16_env(store)  # no DYN_TCP_TLS_*: 1.6.1 dials in the clear
    ours = dict(theirs, PYTHONPATH=SRC, **mutual_tls(pki))
    with DynamoWorker("in=dyn://tls.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name", "our-mock",
                      env=ours, startup_timeout=60) as worker, d16_frontend(theirs, model="our-mock") as frontend:
        started = time.monotonic()
        reply = httpx.post(f"{frontend.url}/v1/completions", timeout=60,
                           json={"model": "our-mock", "prompt": "hello", "max_tokens": 2})
        assert reply.status_code >= 500, reply.text
        assert time.monotonic() - started < 30
        wait_until(lambda: "TLS handshake with 127.0.0.1:" in worker.stderr_text(), 10, "the worker's line")
        [line] = {line.split(" failed: ", 1)[1] for line in worker.stderr_text().splitlines()
                  if "request plane: TLS handshake with" in line}
        assert "plaintext peer" in line, line
