"""The KV router still has a choice when the worker holding a prompt has every slot busy.

Two mocker workers that run one sequence at a time (``max_num_seqs`` 1), on the file store with nothing
else set, behind a KV-routing frontend that logs its decisions (``DYN_ROUTER_LOG``).  A prompt is computed
on one worker; a long answer to it then keeps that worker's only slot busy; a third request with the same
prompt arrives.  A worker takes its engine's slots and as many again queued by default, so the router may
weigh the holder's queue against computing the whole prompt on the idle worker: it waits on the holder and
the engine reuses the prompt.  (When a worker took no more than its slots, the holder counted as full and
the request went to the idle worker, which computed the prompt again: the router had no choice left.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, kv_frontend, sees_instances, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import until

pytestmark = [pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

MODEL = "busy-holder"
BLOCK = 16
MOCKER = {"num_gpu_blocks": 1024, "block_size": BLOCK, "speedup_ratio": 1.0, "max_num_seqs": 1}
PROMPT = "The holder keeps this prompt: " + " ".join(f"item{i}" for i in range(160))


def _log(path: Path) -> list[dict[str, Any]]:
    """The decision log's complete lines so far (the frontend flushes it every half second)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _routes(path: Path) -> list[dict[str, Any]]:
    return [d for d in _log(path) if d.get("ev") == "route"]


async def _scenario(fe: DynamoRun, log: Path) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        async def complete(max_tokens: int) -> dict[str, Any]:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "nvext": {"ignore_eos": True}}
            resp = await client.post(fe.api_url + "/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        first = await complete(1)
        assert not (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        await until(lambda: len(_routes(log)) >= 1, 10, "the first decision in the log")
        holder = _routes(log)[0]["worker"]
        await until(lambda: any(d.get("ev") == "stored" and d.get("worker") == holder for d in _log(log)), 10,
                    "the router to hear that the holder stored the prompt")

        started = asyncio.Event()

        async def long_answer() -> None:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True,
                    "nvext": {"ignore_eos": True}}
            async with client.stream("POST", fe.api_url + "/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()

        busy = asyncio.create_task(long_answer())
        try:
            await asyncio.wait_for(started.wait(), 30)
            await until(lambda: len(_routes(log)) >= 2, 10, "the second decision in the log")
            assert _routes(log)[1]["worker"] == holder, "the long answer went to the prompt's holder"
            third = asyncio.create_task(complete(1))
            await until(lambda: len(_routes(log)) >= 3, 10, "the third request to be routed")
            route = _routes(log)[2]
            assert route["worker"] == holder, (
                f"the prompt's third request went to the idle worker while the holder's slot was busy: "
                f"{route['candidates']}")
            busy.cancel()  # the holder's slot frees; the third request, queued there, runs
            usage = (await asyncio.wait_for(third, 30))["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert cached >= usage["prompt_tokens"] - BLOCK, f"the holder reused the prompt: {usage}"
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)


def test_a_request_waits_on_its_busy_holder_rather_than_computing_the_prompt_again(tiny_model: Path, tmp_path: Path):
    env = {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp_path / "store")}
    args = write_engine_args(tmp_path / "mocker.json", MOCKER)
    workers = [DynamoWorker(f"in=dyn://{MODEL}.mocker.generate", "out=mocker", str(tiny_model), "--model-name",
                            MODEL, "--extra-engine-args", str(args), env=env) for _ in range(2)]
    log = tmp_path / "decisions.jsonl"
    with workers_running(workers):
        with kv_frontend({**env, "DYN_ROUTER_LOG": str(log)}, ready=sees_instances(workers),
                         what="the frontend to see both workers") as fe:
            asyncio.run(_scenario(fe, log))
