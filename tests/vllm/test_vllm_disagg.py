"""vLLM disaggregation on the CPU, with the connector vLLM ships that runs without a GPU: ExampleConnector
(each prefill's KV written as safetensors files under a shared folder, keyed by the prompt; a decode worker
whose prompt matches loads them instead of computing it).

A prefill worker (``--disaggregation-mode prefill``) and a decode worker (``decode``) with the same
``kv_transfer_config`` behind a frontend on real etcd and NATS: a long prompt is prefilled on the prefill
worker (the frontend counts it ``remote``), its KV lands in the shared folder, and the decode worker's vLLM
reports an external cache hit and answers.  NixlConnector (the GPU path, with ``kv_transfer_params`` that
name remote blocks) is not run here: it needs GPUs and NIXL (docs/disaggregation.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, vllm_cache_env, vllm_tier, words
from harness.wait import wait_until

pytestmark = vllm_tier(900)

NS = "vdis"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32


def test_a_long_prompt_is_prefilled_on_the_prefill_worker_and_its_kv_loaded_by_the_decode_worker(
        servers, tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("vllm-disagg-models"))
    cache = tmp_path_factory.mktemp("vllm-disagg-cache")
    shared = tmp_path_factory.mktemp("vllm-disagg-kv")
    args = cache / "args.json"
    args.write_text(json.dumps({"kv_transfer_config": {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)}}}))
    env = {**servers, **vllm_cache_env(cache), "DYN_LOG": "info,dynamo.disagg=debug"}

    def worker(component: str, mode: str) -> DynamoWorker:
        return DynamoWorker(f"in=dyn://{NS}.{component}.generate", "out=vllm", str(model), "--model-name", NS,
                            "--context-length", "1024", "--kv-cache-block-size", str(BLOCK),
                            "--extra-engine-args", str(args), "--disaggregation-mode", mode, env=env,
                            startup_timeout=STARTUP_TIMEOUT)

    prefill, decode = worker("prefill", "prefill"), worker("backend", "decode")
    fe = None
    try:
        prefill.start(wait=False)
        decode.start(wait=False)
        prefill.wait_ready()
        decode.wait_ready()
        fe = DynamoRun("out=dyn", "--max-local-prefill-length", "32", env=servers).start()
        wait_until(lambda: NS in httpx.get(fe.api_url + "/models").text, 60, "the model on the frontend")
        # the prefill worker's entry too (it is not listed in /v1/models, but its instance is on /health)
        prefill_endpoint = f"dyn://{NS}.prefill.generate"
        wait_until(lambda: f"model {NS}: prefill workers at {prefill_endpoint}" in fe.stderr_text() and any(
            i["endpoint"] == prefill_endpoint and i["instance_id"] == prefill.instance_id
            for i in httpx.get(fe.base_url + "/health").json().get("instances", [])), 30,
            "the prefill worker on the frontend")
        prompt = words(120, 3)
        resp = httpx.post(fe.api_url + "/completions", timeout=300, json={
            "model": NS, "prompt": prompt, "max_tokens": 6, "temperature": 0, "nvext": {"ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 6
        metrics = httpx.get(fe.base_url + "/metrics").text
        assert 'dynamo_frontend_disagg_prefill_total{model="vdis",where="remote"} 1.0' in metrics, metrics
        assert list(Path(shared).rglob("*.safetensors")), "the prefill worker's connector stored no KV"
        # vLLM logs from its engine core process
        wait_until(lambda: "External Cache Hit" in decode.stderr_text(), 10, "the decode worker's external cache hit")
        assert "External Cache Hit" not in prefill.stderr_text()
    finally:
        if fe is not None:
            fe.stop()
        for w in (prefill, decode):
            w.stop(timeout=60)
