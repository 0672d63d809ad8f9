"""A mixed fleet on a locked NATS, secured as Dynamo 1.6.1 secures itself: ``dynamo-run-infra --secure``'s NATS
(TLS with client certificates, a token) for the KV events, and TLS with mutual certificates on the TCP planes
(``DYN_TCP_TLS_*``, the same files), every process of both kinds given the same settings (``secure.env`` less
our fleet secret, which 1.x has none of). 1.6.1's mocker and ours publish their KV events on the locked NATS;
our frontend and 1.6.1's each serve both workers' models over TLS.

Discovery is the file store: 1.6.1 does not connect to that etcd (TLS with client certificates and a password:
``etcd not reachable`` with the password settings and without them; its etcd client takes a password or a
client certificate, not both), so a mixed fleet keeps its etcd on a private network (docs/security.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.dynamo1x import d16_env, d16_frontend, d16_mocker
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker
from harness.secure_infra import secure_infra

from .test_d16_serving import chat, wait_listed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """(1.6.1's environment) of a fleet on the locked NATS and a file store, TLS on every plane."""
    root = tmp_path_factory.mktemp("locked")
    with secure_infra(root / "infra") as infra:
        env = {k: v for k, v in infra["env"].items() if k.startswith("NATS_")}
        tls = infra["data"] / "tls"
        env.update({"DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "nats",
                    "DYN_TCP_TLS_CERT_PATH": str(tls / "server.pem"), "DYN_TCP_TLS_KEY_PATH": str(tls / "server-key.pem"),
                    "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": str(tls / "ca.pem"), "DYN_TCP_TLS_CA_CERT_PATH": str(tls / "ca.pem"),
                    "DYN_TCP_TLS_CLIENT_CERT_PATH": str(tls / "client.pem"),
                    "DYN_TCP_TLS_CLIENT_KEY_PATH": str(tls / "client-key.pem")})
        yield d16_env(root / "store", env)


@pytest.fixture(scope="module")
def workers(locked: dict[str, str], tiny_chat_5k: Path) -> Iterator[dict[str, Any]]:
    ours = dict(locked, PYTHONPATH=SRC)
    with d16_mocker(tiny_chat_5k, "dyn://lk16.backend.generate", locked, "--speedup-ratio", "0",
                    model_name="m16-model", store=Path(locked["DYN_FILE_KV"])) as theirs, \
            DynamoWorker("in=dyn://lkours.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name",
                         "our-mock", env=ours, startup_timeout=90) as mine:
        yield {"theirs": theirs, "ours": mine}


def test_both_kinds_of_worker_publish_on_the_locked_nats(workers) -> None:
    theirs = re.sub(r"\x1b\[[0-9;]*m", "", workers["theirs"].stderr_text())
    assert "topic=kv-events transport=Nats" in theirs and " ERROR " not in theirs, theirs[-2000:]
    [line] = [x for x in workers["ours"].stderr_text().splitlines() if "runtime.distributed: discovery " in x]
    assert "event plane nats" in line and "serving mutual, dialing on" in line, line


def test_our_frontend_serves_both_kinds_on_the_locked_fleet(locked: dict[str, str], workers) -> None:
    with DynamoRun("out=dyn", env=dict(locked, PYTHONPATH=SRC), startup_timeout=90) as frontend:
        line = [x for x in frontend.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
        assert "event plane nats" in line[0] and "serving mutual, dialing on" in line[0], line
        for model, words in (("m16-model", True), ("our-mock", False)):
            wait_listed(frontend.base_url, model, 60)
            text, usage, finish = chat(frontend.base_url, model, 4, stream=True)
            assert usage["completion_tokens"] == 4 and finish == "length", (model, text)
            if words:  # 1.6.1's mocker emits the padded vocabulary's filler words
                assert text.count(" w") == 4, text


def test_d16_frontend_serves_both_kinds_on_the_locked_fleet(locked: dict[str, str], workers) -> None:
    with d16_frontend(locked, model="our-mock") as frontend:
        for model in ("our-mock", "m16-model"):
            wait_listed(frontend.url, model, 60)
            text, usage, finish = chat(frontend.url, model, 4, stream=False)
            assert usage["completion_tokens"] == 4 and finish == "length", (model, text)
