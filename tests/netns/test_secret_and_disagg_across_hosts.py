"""A keyed fleet across hosts (tests/netns/conftest.py): every process with the same ``DYN_FLEET_SECRET``
and the TCP request plane, disaggregated prefill and decode on llama.cpp with the prefill worker on one
host and the decode worker on another, so the KV state crosses hosts through the authenticated transfer;
a worker started without the secret is refused in one line and never answers a request."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from harness.fleet import disagg_prefills, served_by
from harness.netns_fleet import chat, sees
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)

SECRET = "the fleet's secret across hosts"
QUESTIONS = ["What is 2+2?", "Name three colors."]


def test_a_keyed_fleet_moves_the_kv_state_across_hosts_and_refuses_a_worker_without_the_secret(
        fleet, topology, gguf: Path):
    ns = f"x{uuid.uuid4().hex[:6]}"
    keyed = {"DYN_FLEET_SECRET": SECRET, "DYN_REQUEST_PLANE": "tcp", "DYN_KV_TRANSFER_TIMEOUT": "20"}
    llama = ("out=llamacpp", str(gguf), "--context-length", "512")
    debug = "info,dynamo.worker.handlers=debug,dynamo.disagg.worker=debug"
    prefill = fleet.worker("w1", f"{ns}.prefill.generate", "dis", "--disaggregation-mode", "prefill", engine=llama,
                           env=fleet.host_env("w1", DYN_LOG=debug, **keyed), startup_timeout=120)
    decode = fleet.worker("w2", f"{ns}.backend.generate", "dis", "--disaggregation-mode", "decode", engine=llama,
                          env=fleet.host_env("w2", DYN_LOG=debug, **keyed), startup_timeout=120)
    member = fleet.worker("w1", f"{ns}.mocker.generate", "m", env=fleet.host_env("w1", DYN_LOG=debug, **keyed))
    stranger = fleet.worker("w2", f"{ns}.mocker.generate", "m", env=fleet.host_env(
        "w2", DYN_LOG=debug, DYN_REQUEST_PLANE="tcp"))
    fe = fleet.frontend("--max-local-prefill-length", "8", env=fleet.host_env("fe", **keyed))
    wait_until(lambda: sees(fe, f"{ns}.backend.generate", [decode]) and sees(fe, f"{ns}.prefill.generate", [prefill])
               and sees(fe, f"{ns}.mocker.generate", [member, stranger]), 60, "the frontend to see every worker")
    assert "fleet secret on" in fe.stderr_text()

    # the prefill worker's transfer server is on its host's address: the decode worker dials across
    transfer = re.search(r"KV transfer server at (\S+):\d+", prefill.stderr_text())
    assert transfer and transfer.group(1) == topology["w1"].address, prefill.stderr_text()[-2000:]
    for q in QUESTIONS:
        resp = chat(fe, "dis", q, f"dis-{uuid.uuid4().hex[:8]}", max_tokens=8, temperature=0)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    assert disagg_prefills(fe, "dis")["remote"] == len(QUESTIONS)
    pulled = re.findall(r"KV state of \d+ tokens, \d+ bytes, pulled", decode.stderr_text())
    assert len(pulled) == len(QUESTIONS), decode.stderr_text()[-3000:]
    assert "no KV state from the prefill worker" not in decode.stderr_text()

    # the worker without the secret: every request answered by the keyed one, the stranger says why
    rids = [f"keyed{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    for rid in rids:
        assert chat(fe, "m", f"question {rid}", rid).status_code == 200
        assert served_by([member, stranger], rid) == [member]
    refusal = [line for line in stranger.stderr_text().splitlines()
               if f"request plane: refused a connection from {topology['fe'].address}:" in line]
    assert refusal and refusal[0].endswith("it authenticates with a fleet secret and this process has none "
                                           "(set DYN_FLEET_SECRET)"), stranger.stderr_text()[-3000:]
