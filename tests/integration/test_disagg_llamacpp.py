"""Disaggregated prefill/decode for real on llama.cpp with the SmolLM2 GGUF.

In process: a prefill engine exports each prompt's KV state, the real TCP transfer moves it, a decode
engine loads it and continues: greedy outputs equal aggregated serving's.  A damaged transfer, or a
state llama.cpp refuses, ends in a local prefill with the same output.  Distributed, under each
configuration of harness/dist_configs.py (etcd and NATS, or nothing started): a prefill worker, a decode
worker and a frontend give the same answers as an aggregated worker, and keep answering when the
prefill worker is killed -9.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import pytest_asyncio

from dynamo.disagg.worker import DisaggWorkerEngine
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions
from harness.dist_configs import DistConfig
from harness.fleet import disagg_prefills, dyn_frontend, sees_instances, workers_running
from harness.proc import DynamoRun, DynamoWorker

pytestmark = pytest.mark.timeout(240)

QUESTIONS = ["What is 2+2?", "Name three colors.", "Write one sentence about the sea.",
             "Say hello in French. " * 8]


def chat(tok: Any, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def req(prompt: list[int], n: int = 12, params: Any = None) -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=list(prompt), stop_conditions=StopConditions(max_tokens=n),
                               sampling_options=SamplingOptions(temperature=0), eos_token_ids=[2],
                               disaggregated_params=params)


async def tokens(engine: Any, r: PreprocessedRequest) -> list[int]:
    return [t async for out in engine.generate(r, Context()) for t in out.token_ids]


async def _engine(gguf: Path) -> Any:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(gguf, context_length=512, args={"n_parallel": 2, "n_threads": 1})
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(gguf):
    pre = DisaggWorkerEngine(await _engine(gguf), "prefill", host="127.0.0.1")
    dec = DisaggWorkerEngine(await _engine(gguf), "decode", pull_timeout=10)
    agg = await _engine(gguf)
    await pre.start()
    try:
        yield pre, dec, agg
    finally:
        for e in (pre, dec, agg):
            await e.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_output_equals_aggregated(engines, tok):
    pre, dec, agg = engines
    for q in QUESTIONS:
        prompt = chat(tok, q)
        [first] = [o async for o in pre.generate(req(prompt), Context())]
        ticket = first.disaggregated_params
        assert ticket["n_tokens"] == len(prompt) and ticket["size"] > 10_000 * len(prompt)
        before = dec.imported
        got = await tokens(dec, req(prompt, params=ticket))
        assert dec.imported == before + 1
        want = await tokens(agg, req(prompt))
        assert got == want and len(got) >= 5, (q, got, want)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("damage", ["digest", "junk_state", "truncated_state"])
async def test_bad_transfer_or_state_falls_back_to_local_prefill(engines, tok, damage):
    pre, dec, agg = engines
    prompt = chat(tok, "Name three colors.")
    [first] = [o async for o in pre.generate(req(prompt), Context())]
    ticket = dict(first.disaggregated_params)
    if damage == "digest":  # what a corrupted stream looks like to the puller
        ticket["sha256"] = hashlib.sha256(b"other").hexdigest()
    else:  # an intact transfer of a state llama.cpp must refuse
        data, _ = pre.store.take(ticket["key"])
        bad = b"\x07" * 64 if damage == "junk_state" else data[: len(data) // 2]
        key, digest = pre.store.put(bad)
        ticket.update(key=key, sha256=digest, size=len(bad))
    fallbacks = dec.fallbacks
    got = await tokens(dec, req(prompt, params=ticket))
    assert dec.fallbacks == fallbacks + 1
    assert got == await tokens(agg, req(prompt))


class Recorded:
    """A traced request's PhaseReport (what the worker's Phases would make spans of), kept as calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def admitted(self) -> None:
        self.calls.append(("admitted",))

    def kv_transfer(self, started_ns: int, n_bytes: int, n_tokens: int, blocks: int | None,
                    error: str | None = None) -> None:
        self.calls.append(("kv_transfer", n_bytes, n_tokens, blocks, error))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_traced_decode_reports_its_transfer_then_its_admission(engines, tok):
    """What a trace's ``kv_transfer`` and ``queue`` spans come from: the pull (its bytes, or why it
    failed), then llama.cpp's scheduler taking the request into a slot."""
    pre, dec, _ = engines
    prompt = chat(tok, "Name three colors.")
    for damage in (False, True):
        [first] = [o async for o in pre.generate(req(prompt), Context())]
        ticket = dict(first.disaggregated_params)
        if damage:
            ticket["sha256"] = hashlib.sha256(b"other").hexdigest()
        ctx, report = Context(), Recorded()
        ctx.phases = report
        got = [t async for out in dec.generate(req(prompt, params=ticket), ctx) for t in out.token_ids]
        assert got
        transfer, admitted = report.calls
        assert admitted == ("admitted",)
        if damage:
            assert transfer[:4] == ("kv_transfer", 0, 0, None) and "does not match" in transfer[4]
        else:
            assert transfer == ("kv_transfer", ticket["size"], len(prompt), None, None)


# -- distributed --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(gguf: Path, dist_config: DistConfig) -> Iterator[dict[str, Any]]:
    env = {**dist_config.env, "DYN_KV_TRANSFER_TIMEOUT": "5"}
    common = ["out=llamacpp", str(gguf), "--context-length", "512"]
    ws = {"prefill": DynamoWorker("in=dyn://dis.prefill.generate", *common, "--model-name", "dis",
                                  "--disaggregation-mode", "prefill", env=env, startup_timeout=120),
          "decode": DynamoWorker("in=dyn://dis.backend.generate", *common, "--model-name", "dis",
                                 "--disaggregation-mode", "decode", env=env, startup_timeout=120),
          "agg": DynamoWorker("in=dyn://agg.backend.generate", *common, "--model-name", "agg", env=env,
                              startup_timeout=120)}
    with workers_running(ws.values()):
        with dyn_frontend(env, "--max-local-prefill-length", "8", ready=sees_instances(ws.values(), models=2),
                          what="the frontend to see the workers") as fe:
            yield {"workers": ws, "frontend": fe}


def ask(fe: DynamoRun, model: str, q: str) -> str:
    r = httpx.post(fe.api_url + "/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_distributed_answers_equal_aggregated_and_survive_prefill_worker_kill(cluster):
    fe = cluster["frontend"]
    for q in QUESTIONS[:3]:
        assert ask(fe, "dis", q) == ask(fe, "agg", q)
    assert disagg_prefills(fe, "dis")["remote"] == 3
    # every state reached the decode worker (with DYN_FLEET_SECRET set, through the handshake too)
    assert "no KV state from the prefill worker" not in cluster["workers"]["decode"].stderr_text()
    cluster["workers"]["prefill"].kill()
    before = disagg_prefills(fe, "dis")
    for q in QUESTIONS[:3]:
        assert ask(fe, "dis", q) == ask(fe, "agg", q)
    after = disagg_prefills(fe, "dis")
    assert after["local"] - before["local"] == 3 and after["remote"] == before["remote"]
