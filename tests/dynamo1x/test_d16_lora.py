"""A LoRA adapter served by a real worker of ours, next to Dynamo 1.6.1's frontend on the same store: 1.6.1 must
not serve it (its requests name no adapter our worker would read, so it would answer with the base model's
weights under the adapter's name).  Our worker announces the adapter with ``model_type`` ``LoraAdapter``, which
1.6.1 rejects as the record appears (a line or three naming it, not one per request): 1.6.1 lists and serves
the base model only; our frontend serves both.

The cheapest real worker with an adapter: llama.cpp (``out=llamacpp``) on the tiny F32 Llama of the interop
tier's model folder, with an F32 adapter of its query projections (harness/lora_gguf.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from harness.dynamo1x import d16_frontend, models_listed
from harness.dynamo1x_kv import SRC, plain_log
from harness.lora_gguf import write_lora_gguf
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_gguf
from harness.wait import wait_until


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})


def test_d16_frontend_serves_the_base_model_and_not_our_workers_adapter(tiny_chat_5k: Path, envs,
                                                                        tmp_path: Path) -> None:
    theirs, ours, _ = envs
    config = json.loads((tiny_chat_5k / "config.json").read_text())
    gguf = build_tiny_gguf(tmp_path / "tiny.gguf", tiny_chat_5k)
    adapter = write_lora_gguf(tmp_path / "sql.gguf", seed=1, layers=config["num_hidden_layers"],
                              n_in=config["hidden_size"], n_out=config["hidden_size"], f32=True)
    ours = dict(ours, PYTHONPATH=SRC, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with DynamoWorker("in=dyn://lora16.backend.generate", "out=llamacpp", str(gguf), "--model-name", "tiny",
                      "--context-length", "512", "--lora", f"tiny-sql={adapter}", env=ours, startup_timeout=120), \
         DynamoRun("out=dyn", env=ours, startup_timeout=60) as our, \
         d16_frontend(theirs, model="tiny") as d16:
        # ours: the base model and the adapter, each answered
        wait_until(lambda: models_listed(our.base_url) == {"tiny", "tiny-sql"}, 30, "our frontend lists both")
        for model in ("tiny", "tiny-sql"):
            reply = _chat(our.base_url, model)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == model
        # 1.6.1: the adapter's record rejected as it appears (its discovery controller's error, its reconciliation
        # naming the adapter's key, its runtime-config watcher: one line each), the base model listed and served
        wait_until(lambda: "unrecognized named flag `LoraAdapter`" in plain_log(d16), 30,
                   "1.6.1 rejecting the adapter's record")
        assert models_listed(d16.url) == {"tiny"}
        for _ in range(3):
            reply = _chat(d16.url, "tiny")
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert _chat(d16.url, "tiny-sql").status_code == 404
        said = [line for line in plain_log(d16).splitlines() if "LoraAdapter" in line]
        assert 1 <= len(said) <= 3 and any("tiny-sql" in line for line in said), said  # not one per request
