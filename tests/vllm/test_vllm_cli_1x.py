"""Dynamo 1.x's vLLM launch, unchanged: ``python -m dynamo.frontend`` in front of ``python -m dynamo.vllm --model M``
with vLLM's own engine flags (``--max-model-len``, ``--block-size``, ``--enforce-eager``, ``--kv-events-config``,
as 1.x's README writes them), on the file store with nothing else started: the worker is our vllm engine, the
flags reach vLLM, and chat answers through the frontend."""

from __future__ import annotations

import sys
from typing import Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, infra_on_default_ports
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, running, vllm_cache_env, vllm_tier
from harness.wait import wait_until

pytestmark = vllm_tier()


class V1Frontend(DynamoRun):
    """``python -m dynamo.frontend`` on a free loopback port."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dynamo.frontend", *self.args, "--http-host", "127.0.0.1",
                "--http-port", str(self.port)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V1Frontend]:
    if infra_on_default_ports():
        pytest.skip("an etcd or NATS answers on the default ports: the one-machine rule would take it")
    model = build_tiny_hf_model(tmp_path_factory.mktemp("v1-vllm-model"))
    env = {**NO_INFRA_ENV, **vllm_cache_env(tmp_path_factory.mktemp("v1-vllm-cache")),
           "DYN_FILE_KV": str(tmp_path_factory.mktemp("v1-vllm") / "store")}
    worker = DynamoWorker("--model", str(model), "--discovery-backend", "file", "--max-model-len", "1024",
                          "--block-size", "32", "--enforce-eager",
                          "--kv-events-config", '{"enable_kv_cache_events": false}',
                          command=[sys.executable, "-m", "dynamo.vllm"], env=env, startup_timeout=STARTUP_TIMEOUT)
    with running(worker), V1Frontend("--discovery-backend", "file", env=env) as frontend:
        wait_until(lambda: httpx.get(f"{frontend.base_url}/v1/models").json()["data"], 60,
                   "the frontend to list the vLLM worker's model")
        yield frontend


def test_chat_through_a_1x_launched_vllm_fleet(fleet: V1Frontend) -> None:
    served = httpx.get(f"{fleet.base_url}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"{fleet.base_url}/v1/chat/completions", timeout=120, json={
        "model": served, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("length", "stop")
