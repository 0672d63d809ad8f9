"""``dynamo-run in=dyn://... out=vllm --embedding``: a vLLM pooling worker registers as
``ModelType.Embedding`` on real etcd + NATS, and an ``out=dyn`` frontend serves its vectors on
``/v1/embeddings`` (float, and base64 as the ``openai`` SDK asks by default), the same vectors as the
model run by ``transformers``.  The vLLM tier (``scripts/test-vllm.sh``); a module of its own so the
local server of test_vllm_embeddings.py is gone before this vLLM starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, vllm_tier
from harness.wait import wait_until
from tests.vllm.test_vllm_embeddings import EXTRA_ARGS, TEXTS, reference

pytestmark = vllm_tier()

MODEL = "tiny-embed-worker"


def test_a_vllm_embedding_worker_behind_a_frontend(tmp_path: Path) -> None:
    model = build_tiny_hf_model(tmp_path / "models")
    extra = tmp_path / "vllm_extra.json"
    extra.write_text(json.dumps(EXTRA_ARGS))
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        worker = DynamoWorker("in=dyn://emb.vllm.embed", "out=vllm", str(model), "--embedding", "--model-name", MODEL,
                              "--context-length", "256", "--extra-engine-args", str(extra),
                              env={**env, "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}, startup_timeout=STARTUP_TIMEOUT)
        with worker, DynamoRun("out=dyn", env=env) as frontend:
            assert "as embedding" in worker.stderr_text().lower()
            client = openai.OpenAI(base_url=frontend.api_url, api_key="unused", max_retries=0, timeout=120)
            wait_until(lambda: MODEL in {m.id for m in client.models.list().data}, 30, "the worker's model")
            want, tokens = reference(model, TEXTS)
            floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
            assert floats.usage.prompt_tokens == tokens
            for got, ref in zip(floats.data, want, strict=True):
                assert got.embedding == pytest.approx(ref, abs=1e-4)
            decoded = client.embeddings.create(model=MODEL, input=TEXTS).data  # base64, decoded by the SDK
            for got, ref in zip(decoded, floats.data, strict=True):
                assert got.embedding == pytest.approx(ref.embedding, abs=1e-6)
            r = httpx.post(frontend.api_url + "/embeddings", json={"model": MODEL, "input": "x", "dimensions": 8},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
        assert worker.returncode == 0, worker.stderr_text()[-4000:]
