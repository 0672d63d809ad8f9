"""LoRA adapters as a user serves them, with the real SmolLM2 GGUF and adapters from harness/lora_gguf.py:
``--lora name=path`` at start and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time
(behind ``DYN_ALLOW_RUNTIME_LORA_UPDATING``), each adapter a model in ``/v1/models``
with its ``parent``, bad adapters as clear errors (CLI: one line, exit 1; HTTP: 400/404 in the OpenAI
shape) while the server keeps serving; and, through ``out=dyn`` with real etcd and NATS, an adapter's
requests going only to the worker that announced it."""

from __future__ import annotations

import re
from typing import Iterator

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
    other = write_lora_gguf(tmp_path / "other.gguf", seed=2, scale=4.0)
    env = {"DYN_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with DynamoRun("out=llamacpp", str(gguf), "--model-name", "smol", "--context-length", "512",
                   "--extra-engine-args", str(args_file), "--lora", f"strong={adapter}",
                   env=env, startup_timeout=120, api_key=KEY) as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key=KEY)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"smol", "strong"}
        assert listed["strong"].model_extra == {"root": str(adapter), "parent": "smol"}
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
            assert models["strong"].model_extra == {"root": str(adapter), "parent": "smol"}
            base = lora_answer(client, "smol")
            strong = [lora_answer(client, "strong") for _ in range(4)]  # round-robin would alternate workers
            assert len(set(strong)) == 1 and strong[0] != base
            assert [lora_answer(client, "smol") for _ in range(2)] == [base, base]
    finally:
        for w in ws:
            w.kill()
