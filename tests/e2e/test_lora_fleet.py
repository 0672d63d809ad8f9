"""Run-time LoRA adapters on a frontend of workers (``out=dyn``), with real etcd and NATS, SmolLM2 workers
on llama.cpp and adapters from harness/lora_gguf.py: ``/v1/load_lora_adapter`` reaches every worker of
the base model, which loads and announces the adapter, so the frontend lists and routes it; unloading
withdraws it; a load that fails on one worker is undone on the others and the error says which worker
said what; the routes want the API key; and a worker asked for an adapter it does not serve says so
instead of answering with its base model's weights."""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from dynamo.runtime import DistributedRuntime, EngineError, EtcdSettings, NatsSettings, RuntimeSettings
from harness.lora_gguf import lora_answer
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(300)
KEY = "sk-lora-fleet"
ALLOW = {"DYN_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture
def servers() -> Iterator[tuple[EtcdServer, NatsServer]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield etcd, nats_srv


def env_of(servers: tuple[EtcdServer, NatsServer], **extra: str) -> dict[str, str]:
    etcd, nats_srv = servers
    return {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url, **extra}


def workers(servers, gguf: Path, args_file: Path, envs: list[dict[str, str]]) -> list[DynamoWorker]:
    ws = [DynamoWorker("in=dyn://fleet.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name", "smol",
                       "--context-length", "512", "--extra-engine-args", str(args_file),
                       env=env_of(servers, **e), startup_timeout=120).start(wait=False) for e in envs]
    for w in ws:
        w.wait_ready()
    return ws


def listed(client: openai.OpenAI) -> dict[str, dict]:
    return {m.id: m.model_extra or {} for m in client.models.list().data}


async def ask_worker_directly(servers, model: str) -> str:
    """A generate request naming ``model`` sent to a worker by the runtime (no frontend in between):
    the error it answers with."""
    etcd, nats_srv = servers
    rt = await DistributedRuntime.connect(RuntimeSettings(etcd=EtcdSettings(endpoints=[etcd.url]),
                                                          nats=NatsSettings(server=nats_srv.url)))
    try:
        client = await rt.namespace("fleet").component("llamacpp").endpoint("generate").client()
        await client.wait_for_instances(timeout=10)
        request = {"token_ids": [1, 2, 3, 4], "model": model, "stop_conditions": {"max_tokens": 2}}
        with pytest.raises(EngineError) as err:
            async for _ in client.round_robin(request):
                pass
        return str(err.value)
    finally:
        await rt.close()


def test_run_time_adapters_reach_every_worker_through_the_frontend(servers, gguf, adapter, args_file, tmp_path):
    ws = workers(servers, gguf, args_file, [ALLOW, ALLOW])
    try:
        with DynamoRun("out=dyn", env=env_of(servers, **ALLOW), api_key=KEY) as fe:
            client = openai.OpenAI(base_url=fe.api_url, api_key=KEY, max_retries=0)
            wait_until(lambda: "smol" in listed(client), 30, "the base model")
            base = lora_answer(client, "smol")
            http = httpx.Client(base_url=fe.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            body = {"lora_name": "strong", "lora_path": str(adapter)}
            # the routes want the API key like every model route
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = httpx.post(fe.base_url + route, json=body, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert set(listed(client)) == {"smol"}

            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 200 and "added successfully" in r.text, r.text
            # listed and routable as soon as the call returns, on both workers
            assert listed(client)["strong"] == {"root": str(adapter), "parent": "smol", "input_modalities": ["text"]}
            for w in ws:
                assert "LoRA adapter strong loaded from" in w.stderr_text()
            strong = {lora_answer(client, "strong") for _ in range(4)}  # round-robin: both workers answer
            assert len(strong) == 1 and strong != {base}
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]

            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "strong"})
            assert r.status_code == 200 and "removed successfully" in r.text, r.text
            assert set(listed(client)) == {"smol"}
            with pytest.raises(openai.NotFoundError):
                lora_answer(client, "strong")
            for w in ws:
                assert "LoRA adapter strong withdrawn and unloaded" in w.stderr_text()
            # a worker asked for the adapter it no longer serves refuses: never the base model's weights
            error = asyncio.run(ask_worker_directly(servers, "strong"))
            assert "'strong' is not served by this worker" in error and "'smol'" in error
            assert "'ghost' is not served" in asyncio.run(ask_worker_directly(servers, "ghost"))

            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "strong"})
            assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "smol"})
            assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
            # a bad file: every worker says why, in the OpenAI error shape; nothing is listed
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "no.gguf")})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and "2 of 2 worker(s) of 'smol' failed" in message
            assert message.count("no such file") == 2
            r = http.post("/v1/load_lora_adapter", json={**body, "base_model_name": "nope"})
            assert r.status_code == 404
            assert set(listed(client)) == {"smol"} and lora_answer(client, "smol") == base
            # loaded again after all that: served as before
            assert http.post("/v1/load_lora_adapter", json={**body, "base_model_name": "smol"}).status_code == 200
            assert lora_answer(client, "strong") in strong
    finally:
        for w in ws:
            w.stop()


def test_a_load_that_fails_on_one_worker_is_undone_on_the_others(servers, gguf, adapter, args_file):
    # the second worker's operator did not allow run-time loading
    ws = workers(servers, gguf, args_file, [ALLOW, {}])
    try:
        with DynamoRun("out=dyn", env=env_of(servers, **ALLOW)) as fe:
            client = openai.OpenAI(base_url=fe.api_url, api_key="none", max_retries=0)
            wait_until(lambda: "smol" in listed(client), 30, "the base model")
            r = httpx.post(fe.base_url + "/v1/load_lora_adapter",
                           json={"lora_name": "strong", "lora_path": str(adapter)}, timeout=120)
            message = r.json()["error"]["message"]
            assert r.status_code == 400, message
            assert "1 of 2 worker(s) of 'smol' failed" in message
            assert f"worker {ws[1].instance_hex}" in message and "off on this worker" in message
            assert "unloaded again from the 1 worker(s) that had loaded it" in message
            # no half state: not listed, not routable, and the worker that had it no longer has it
            assert set(listed(client)) == {"smol"}
            with pytest.raises(openai.NotFoundError):
                lora_answer(client, "strong")
            assert "LoRA adapter strong withdrawn and unloaded" in ws[0].stderr_text()
            assert lora_answer(client, "smol")
    finally:
        for w in ws:
            w.stop()


def test_a_worker_killed_during_a_load_leaves_the_fleet_and_the_load_stands_on_the_others(
        servers, gguf, adapter, args_file):
    """Worker 2 is frozen (SIGSTOP) before the load, so its load cannot finish; once worker 1 has loaded
    the adapter (the fleet's call is under way on both), worker 2 is killed -9.  Its lease expires, so
    it has left the fleet: the load stands on worker 1, the base model is served throughout, /v1/models
    lists what the live worker serves, and a worker that comes back gets the adapter on the next load."""
    short_lease = {**ALLOW, "DYN_LEASE_TTL": "3"}  # the dead worker's entries go within seconds
    ws = workers(servers, gguf, args_file, [short_lease, short_lease])
    try:
        with DynamoRun("out=dyn", env=env_of(servers, **ALLOW)) as fe:
            client = openai.OpenAI(base_url=fe.api_url, api_key="none", max_retries=0, timeout=120)
            wait_until(lambda: "smol" in listed(client), 30, "the base model")
            base = lora_answer(client, "smol")
            body = {"lora_name": "strong", "lora_path": str(adapter)}
            ws[1].terminate(signal.SIGSTOP)
            with ThreadPoolExecutor(1) as pool:
                load = pool.submit(httpx.post, fe.base_url + "/v1/load_lora_adapter", json=body, timeout=120)
                wait_until(lambda: "LoRA adapter strong loaded from" in ws[0].stderr_text(), 60,
                           "worker 1's load")
                assert not load.done()  # waiting for worker 2, which cannot answer
                ws[1].kill()
                assert lora_answer(client, "smol") == base  # served meanwhile, by the worker that remains
                r = load.result()
            assert r.status_code == 200 and "added successfully" in r.text, r.text
            assert f"worker {ws[1].instance_hex}" in fe.stderr_text()
            assert "left the fleet during the load" in fe.stderr_text()
            # listed because a live worker serves it; its requests are answered with the adapter's weights
            models = listed(client)
            assert set(models) == {"smol", "strong"}
            assert models["strong"] == {"root": str(adapter), "parent": "smol", "input_modalities": ["text"]}
            strong = lora_answer(client, "strong")
            assert strong != base and lora_answer(client, "smol") == base
            assert "LoRA adapter strong withdrawn" not in ws[0].stderr_text()  # never undone

            # the dust settled: a worker comes back, and loading again reaches it as well
            ws[1] = workers(servers, gguf, args_file, [short_lease])[0]
            http = httpx.Client(base_url=fe.base_url, timeout=120)
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "strong"}).status_code == 200
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 200 and "added successfully" in r.text, r.text
            assert "LoRA adapter strong loaded from" in ws[1].stderr_text()
            assert {lora_answer(client, "strong") for _ in range(4)} == {strong}  # both workers answer alike
    finally:
        for w in ws:
            w.kill()
