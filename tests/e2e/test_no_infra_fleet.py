"""A distributed user's first step with neither etcd nor NATS: two llama.cpp workers with SmolLM2 and a
KV-routed frontend, started as the README says (``dynamo-run in=dyn://ns.backend.generate out=llamacpp
model.gguf``, ``dynamo-run in=http out=dyn --router-mode kv``), no flags for discovery or the planes and
no server processes. The processes find each other through the file store, requests go over TCP, the
workers' KV events over ZMQ (the frontend's decision log shows them arriving and a repeated prefix
routed to the worker that holds it), and the model card's tokenizer through the file object store.

The only setting is ``DYN_FILE_KV``, the store's directory, so that parallel test runs do not share
``$TMPDIR/dynamo_store_kv``; it does not change the rule. ``ETCD_ENDPOINTS`` and ``NATS_SERVER`` are
emptied (as if unset); an etcd or NATS on this machine's default ports would change what the rule
chooses, so the test is skipped when one answers there.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, WORKER_LOG, served_by, wait_for_model
from harness.proc import DynamoRun, DynamoWorker
from harness.smollm2 import SMOLLM2_MODEL, NotInstalled, smollm2_gguf
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENDPOINT = "dyn://ns.backend.generate"


@pytest.fixture(scope="module")
def fleet(no_default_infra: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    try:
        gguf = smollm2_gguf()
    except NotInstalled as e:
        pytest.skip(str(e))
    tmp = tmp_path_factory.mktemp("noinfra")
    env = {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp / "store")}
    decisions = tmp / "decisions.jsonl"
    workers = [DynamoWorker(f"in={ENDPOINT}", "out=llamacpp", str(gguf), "--context-length", "1024",
                            env={**env, **WORKER_LOG}).start(wait=False) for _ in range(2)]
    fe = None
    try:
        for w in workers:
            w.wait_ready(120)
        fe = DynamoRun("out=dyn", "--router-mode", "kv", env={**env, "DYN_ROUTER_LOG": str(decisions)}).start()
        wait_for_model(fe, SMOLLM2_MODEL, ENDPOINT, 2, timeout=30)
        yield {"workers": workers, "frontend": fe, "decisions": decisions}
    finally:
        if fe is not None:
            fe.stop()
        for w in workers:
            w.kill()


def ask(fe: DynamoRun, content: str, rid: str) -> str:
    r = httpx.post(fe.api_url + "/chat/completions", timeout=60, headers={"x-request-id": rid}, json={
        "model": SMOLLM2_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_every_process_says_what_it_chose_in_one_line(fleet):
    for proc in [*fleet["workers"], fleet["frontend"]]:
        lines = [x for x in proc.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
        assert len(lines) == 1, lines
        assert "discovery file (" in lines[0] and "no etcd at http://localhost:2379" in lines[0], lines[0]
        assert "request plane tcp, event plane zmq (no NATS at nats://localhost:4222)" in lines[0], lines[0]
        assert "object store files" in lines[0], lines[0]


def test_kv_routed_answers_with_no_servers(fleet):
    fe, workers = fleet["frontend"], fleet["workers"]
    prefix = " ".join(f"Item {i} is a fruit called name{i}." for i in range(40))  # several KV blocks
    assert ask(fe, prefix + " Which item is first?", "first-req")

    def routes() -> list[dict[str, Any]] | None:
        try:
            lines = [json.loads(x) for x in fleet["decisions"].read_text().splitlines()]
        except (OSError, ValueError):
            return None
        stored = [x for x in lines if x["ev"] == "stored"]
        return lines if stored else None

    # the worker's KV events reached the frontend over ZMQ before the second request is routed
    wait_until(routes, 10, "the first request's KV events in the frontend's decision log")
    assert ask(fe, prefix + " Which item is last?", "second-req")
    lines = wait_until(lambda: (r := routes()) and len([x for x in r if x["ev"] == "route"]) == 2 and r, 10,
                       "two routing decisions in the decision log")
    first, second = [x for x in lines if x["ev"] == "route"]
    assert first["worker"] == second["worker"]
    assert second["candidates"][second["worker"]]["overlap"] > 0
    assert [w for w in workers if served_by([w], "first-req")] == [w for w in workers if served_by([w], "second-req")]
