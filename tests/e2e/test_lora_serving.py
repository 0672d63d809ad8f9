"""LoRA adapters as a user serves them, with the real SmolLM2 GGUF and adapters from harness/lora_gguf.py:
``--lora name=path`` at start and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time
(behind ``DYN_ALLOW_RUNTIME_LORA_UPDATING``), each adapter a model in ``/v1/models``
with its ``parent``, bad adapters as clear errors (CLI: one line, exit 1; HTTP: 400/404 in the OpenAI
shape) while the server keeps serving; and, through ``out=dyn`` with real etcd and NATS, an adapter's
requests going only to the worker that announced it."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from harness.lora_gguf import lora_answer, write_lora_gguf
from harness.proc import DynamoRun, DynamoWorker, run_cli
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(240)
KEY = "sk-lora-test"


def test_start_and_run_time_adapters_over_http(gguf, adapter, args_file, tmp_path):
    other = write_lora_gguf(tmp_path / "other.gguf", seed=2, scale=1.0)
    env = {"DYN_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with DynamoRun("out=llamacpp", str(gguf), "--model-name", "smol", "--context-length", "512",
                   "--extra-engine-args", str(args_file), "--lora", f"strong={adapter}",
                   env=env, startup_timeout=120, api_key=KEY) as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key=KEY)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"smol", "strong"}
        assert listed["strong"].model_extra == {"root": str(adapter), "parent": "smol", "input_modalities": ["text"]}
        base, strong = lora_answer(client, "smol"), lora_answer(client, "strong")
        assert base and strong and base != strong
        post = httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        # the routes want the API key; without it nothing is loaded or unloaded
        for route, body in (("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(other)}),
                            ("/v1/unload_lora_adapter", {"lora_name": "strong"})):
            r = httpx.post(srv.base_url + route, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert set(m.id for m in client.models.list().data) == {"smol", "strong"}
        # run time: load, serve, unload
        r = post.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(other)})
        assert r.status_code == 200 and "added successfully" in r.text
        assert "other" in {m.id for m in client.models.list().data}
        assert lora_answer(client, "other") not in (base, strong)
        r = post.post("/v1/unload_lora_adapter", json={"lora_name": "other"})
        assert r.status_code == 200 and "removed successfully" in r.text
        with pytest.raises(openai.NotFoundError):
            lora_answer(client, "other")
        # errors in the OpenAI shape; the server keeps serving
        r = post.post("/v1/unload_lora_adapter", json={"lora_name": "other"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
        r = post.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(gguf)})
        assert r.status_code == 400 and "not an adapter" in r.json()["error"]["message"]
        r = post.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "no.gguf")})
        assert r.status_code == 400 and "no such file" in r.json()["error"]["message"]
        r = post.post("/v1/load_lora_adapter", json={"lora_name": "strong", "lora_path": str(other)})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = post.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert lora_answer(client, "strong") == strong and lora_answer(client, "smol") == base


def test_run_time_loading_is_off_unless_the_operator_allows_it(gguf, args_file, adapter):
    with DynamoRun("out=llamacpp", str(gguf), "--context-length", "256", "--extra-engine-args", str(args_file),
                   startup_timeout=120) as srv:
        r = httpx.post(srv.base_url + "/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": str(adapter)})
        assert r.status_code == 404


def test_a_bad_adapter_at_start_is_one_line_and_exit_1(gguf, tmp_path):
    bad = write_lora_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    r = run_cli(["in=http", "out=llamacpp", str(gguf), "--context-length", "256", "--http-port", "0",
                 "--lora", f"q={bad}"], timeout=120)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "architecture" in errors[0] and "Traceback" not in r.stderr, r.stderr
    r = run_cli(["in=http", "out=llamacpp", str(gguf), "--lora", "nopath"], timeout=60)
    assert r.returncode != 0 and "NAME=PATH" in r.stderr


# -- distributed ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
def test_an_adapters_requests_go_only_to_the_worker_that_has_it(servers, gguf, adapter, args_file, mode):
    common = ("out=llamacpp", str(gguf), "--model-name", "smol", "--context-length", "512",
              "--extra-engine-args", str(args_file))
    ns = f"lora{mode.replace('-', '')}"
    ws = [DynamoWorker(f"in=dyn://{ns}.llamacpp.generate", *common, *extra, env=servers, startup_timeout=120
                       ).start(wait=False) for extra in ((), ("--lora", f"strong={adapter}"))]
    try:
        for w in ws:
            w.wait_ready()
        with DynamoRun("out=dyn", "--router-mode", mode, env=servers) as fe:
            wait_until(lambda: re.search(r"added model strong", fe.stderr_text()), 30, "the adapter's model")
            client = openai.OpenAI(base_url=fe.api_url, api_key="none")
            models = {m.id: m for m in client.models.list().data}
            assert models["strong"].model_extra == {"root": str(adapter), "parent": "smol", "input_modalities": ["text"]}
            base = lora_answer(client, "smol")
            strong = [lora_answer(client, "strong") for _ in range(4)]  # round-robin would alternate workers
            assert len(set(strong)) == 1 and strong[0] != base
            assert [lora_answer(client, "smol") for _ in range(2)] == [base, base]
    finally:
        for w in ws:
            w.kill()


def route_lines(log: Path) -> list[dict[str, Any]]:
    """The routing decisions in a decision log (DYN_ROUTER_LOG) so far."""
    try:
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []
    return [x for x in lines if x["ev"] == "route"]


def test_an_adapters_requests_and_its_base_models_share_one_load_per_worker(gguf, adapter, args_file, tmp_path):
    """Both workers serve the base model and the adapter.  A long request is in flight on one of them;
    the next request, for the other model, goes to the other worker: its router sees the first request's
    load at once (the decision log shows it), in both directions.  NATS is frozen meanwhile (requests go
    over TCP), so no event-plane echo of the first booking can stand in for the shared bookings."""
    common = ("out=llamacpp", str(gguf), "--model-name", "smol", "--context-length", "512",
              "--extra-engine-args", str(args_file), "--lora", f"strong={adapter}", "--request-plane", "tcp")
    decisions = tmp_path / "decisions.jsonl"
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
        ws = [DynamoWorker("in=dyn://sharedload.llamacpp.generate", *common, env=env, startup_timeout=120
                           ).start(wait=False) for _ in range(2)]
        try:
            for w in ws:
                w.wait_ready()
            with DynamoRun("out=dyn", "--router-mode", "kv", "--request-plane", "tcp",
                           env={**env, "DYN_ROUTER_LOG": str(decisions)}) as fe:
                wait_until(lambda: re.search(r"added model strong", fe.stderr_text()), 30, "the adapter's model")
                client = openai.OpenAI(base_url=fe.api_url, api_key="none", max_retries=0, timeout=120)
                long_prompt = "Tell me a very long story about a dragon, a knight and a castle by the sea. " * 4
                for held, other in (("strong", "smol"), ("smol", "strong")):
                    before = len(route_lines(decisions))
                    assert nats_srv.proc is not None
                    os.kill(nats_srv.proc.pid, signal.SIGSTOP)
                    try:
                        stream = client.chat.completions.create(
                            model=held, messages=[{"role": "user", "content": long_prompt}], max_tokens=400,
                            temperature=0, stream=True, extra_body={"ignore_eos": True})
                        next(iter(stream))  # in flight on its worker
                        client.chat.completions.create(model=other, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=2)
                        stream.close()
                    finally:
                        os.kill(nats_srv.proc.pid, signal.SIGCONT)
                    found = wait_until(lambda n=before: (r := route_lines(decisions)[n:]) and len(r) >= 2 and r,
                                       10, "both decisions in the log")
                    long_route, short_route = sorted(found[:2], key=lambda r: -r["isl"])
                    busy = long_route["worker"]
                    # the other model's router saw the held request on its worker, and chose the idle one
                    assert short_route["candidates"][busy]["requests"] == 1, short_route
                    assert short_route["worker"] != busy, short_route
        finally:
            for w in ws:
                w.kill()
