"""A vLLM worker serving a LoRA adapter behind a KV router: ``dynamo-run in=dyn://... out=vllm --lora
strong=<PEFT folder>`` and ``in=http out=dyn --router-mode kv``, with real etcd and nats-server.

The worker announces the adapter as a model of its own (``parent`` its base); vLLM's KV events of the
adapter's blocks name it (``lora_name``) and are hashed under the adapter's salt, so the router finds a
prompt cached for the adapter when the adapter asks again, and not when the base model asks for the same
tokens; vLLM's own ``cached_tokens`` agrees (it keys its prefix cache by the adapter too).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import nats
import pytest

from harness.events import nats_subject, payload
from harness.lora_peft import write_peft_lora
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, kv_frontend, running, vllm_cache_env, vllm_tier, words

pytestmark = vllm_tier()

NS = "vlora"
BLOCK = 32


@pytest.fixture(scope="module")
def worker(servers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoWorker]:
    model = build_tiny_hf_model(tmp_path_factory.mktemp("vllm-lora-worker-models"))
    adapter = write_peft_lora(tmp_path_factory.mktemp("vllm-lora-worker-adapters") / "strong", model, seed=1)
    cache = tmp_path_factory.mktemp("vllm-lora-worker-cache")
    with running(DynamoWorker(f"in=dyn://{NS}.vllm.generate", "out=vllm", str(model), "--model-name", "base",
                              "--context-length", "1024", "--kv-cache-block-size", str(BLOCK),
                              "--lora", f"strong={adapter}", env={**servers, **vllm_cache_env(cache)},
                              startup_timeout=STARTUP_TIMEOUT)) as w:
        yield w


@pytest.fixture(scope="module")
def frontend(servers: dict[str, str], worker: DynamoWorker) -> Iterator[DynamoRun]:
    def lists_adapter(fe: DynamoRun) -> bool:
        return "strong" in {m["id"] for m in httpx.get(fe.api_url + "/models").json()["data"]}

    with kv_frontend(servers, lists_adapter, "the frontend to list the worker's adapter") as fe:
        yield fe


async def _run(servers: dict[str, str], fe: DynamoRun) -> dict[str, Any]:
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_decision(msg: Any) -> None:
        decisions.put_nowait(payload(msg.data))

    await nc.subscribe(nats_subject(NS, "kv-hit-rate"), cb=on_decision)
    await nc.flush()
    prompt = words(150, 7)
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            async def send(model: str, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
                body = {"model": model, "prompt": text, "max_tokens": 4, "temperature": 0}
                resp = await client.post(fe.api_url + "/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()["usage"], await asyncio.wait_for(decisions.get(), 10)

            out["first"] = await send("strong", prompt + " first")
            for _ in range(50):  # events travel asynchronously: until the router sees the adapter's prefix
                out["again"] = await send("strong", prompt + " again")
                if out["again"][1]["overlap_blocks"] > 0:
                    break
                await asyncio.sleep(0.2)
            out["base"] = await send("base", prompt + " base")
    finally:
        await nc.close()
    return out


def test_an_adapters_blocks_are_its_own_in_the_router_and_in_vllm(servers, worker, frontend):
    models = {m["id"]: m for m in httpx.get(frontend.api_url + "/models").json()["data"]}
    assert models["strong"]["parent"] == "base"
    r = asyncio.run(_run(servers, frontend))
    (usage1, decision1), (usage2, decision2), (usage3, decision3) = r["first"], r["again"], r["base"]
    print(f"\nfirst: {decision1} {usage1}\nagain: {decision2} {usage2}\nbase: {decision3} {usage3}")
    assert decision1["overlap_blocks"] == 0 and decision1["isl_blocks"] >= 10
    # the router found the adapter's prefix from the worker's events, hashed under the adapter's salt ...
    assert decision2["overlap_blocks"] >= decision1["isl_blocks"] - 2, decision2
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= (decision2["overlap_blocks"] - 1) * BLOCK
    # ... and the base model's same tokens match none of them, in the router and in vLLM
    assert decision3["overlap_blocks"] == 0, decision3
    assert (usage3.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, usage3
