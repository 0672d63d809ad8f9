"""Prompt logprobs from a worker of ours to Dynamo 1.6.1's frontend.

1.6.1 forwards a request's ``prompt_logprobs`` (vLLM's extension) to the worker in ``output_options`` and reads
the answer from the last item's ``engine_data["prompt_logprobs"]``, vLLM's shape (per prompt token null, or
``{"<token id>": {"logprob", "rank"}}``).  It returns them in the response's ``nvext.prompt_logprobs`` when the
client asks for that field (``nvext.extra_fields: ["prompt_logprobs"]``), and a unary chat completion also as a
top-level ``prompt_logprobs``.  Our llama.cpp worker (the tiny F32 Llama) computes them; the numbers are the
ones our own frontend gives for the same prompt (``echo`` with ``logprobs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from harness.dynamo1x import d16_env, d16_frontend, models_listed
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_gguf
from harness.wait import wait_until

PROMPT = [1000 + (i * 37) % 3000 for i in range(12)]
ASK = {"prompt_logprobs": 2, "nvext": {"extra_fields": ["prompt_logprobs"]}}


def _check(rows: list, prompt: list[int]) -> list[float]:
    """1.x's PromptLogprobs of ``prompt``: null first, then each token's own logprob among its alternatives."""
    assert len(rows) == len(prompt) and rows[0] is None, rows
    mine = []
    for tid, row in zip(prompt[1:], rows[1:], strict=True):
        assert str(tid) in row and 1 <= len(row) <= 3, row  # the token itself and its 2 best alternatives
        assert sorted(e["rank"] for e in row.values() if "rank" in e) == [1, 2], row
        mine.append(row[str(tid)]["logprob"])
    assert all(lp <= 0 for lp in mine)
    return mine


def test_d16_frontend_returns_our_workers_prompt_logprobs(tiny_chat_5k: Path, store: Path, tmp_path: Path) -> None:
    gguf = build_tiny_gguf(tmp_path / "tiny.gguf", tiny_chat_5k)
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with DynamoWorker("in=dyn://plp16.backend.generate", "out=llamacpp", str(gguf), "--model-name", "tiny",
                      "--context-length", "512", env=ours, startup_timeout=120), \
         DynamoRun("out=dyn", env=ours, startup_timeout=60) as our, \
         d16_frontend(theirs, model="tiny") as d16:
        wait_until(lambda: "tiny" in models_listed(our.base_url), 30, "our frontend lists the model")
        # what our own frontend says of the prompt's tokens
        reply = httpx.post(f"{our.base_url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        expected = reply.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(PROMPT)]

        # 1.6.1, completions, unary and streamed: in nvext, on the last chunk
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **ASK}
        reply = httpx.post(f"{d16.url}/v1/completions", timeout=60, json=body)
        assert reply.status_code == 200, reply.text
        assert _check(reply.json()["nvext"]["prompt_logprobs"], PROMPT) == pytest.approx(expected, abs=1e-3)
        found = []
        with httpx.stream("POST", f"{d16.url}/v1/completions", timeout=60, json=dict(body, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    found += [chunk["nvext"]["prompt_logprobs"]] if "prompt_logprobs" in (chunk.get("nvext") or {}) else []
        assert len(found) == 1 and _check(found[0], PROMPT) == pytest.approx(expected, abs=1e-3)

        # chat, unary: top-level as vLLM has it, without asking for the nvext field
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "prompt_logprobs": 1}
        reply = httpx.post(f"{d16.url}/v1/chat/completions", timeout=60, json=chat)
        assert reply.status_code == 200, reply.text
        rows = reply.json()["prompt_logprobs"]
        assert rows[0] is None and len(rows) == reply.json()["usage"]["prompt_tokens"]
        assert all(len(row) in (1, 2) for row in rows[1:])
