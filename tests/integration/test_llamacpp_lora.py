"""LoRA adapters on the llama.cpp engine, in process, with the real SmolLM2 GGUF and adapters written by
harness/lora_gguf.py: a non-zero adapter changes greedy output and a zero one does not; adapters and the
base model run concurrently, each answering as it does alone; a prefix cached under one adapter is not
reused (nor reported as ``cached_tokens``, nor matched by the router) for another or the base; unloading
lets a running request finish; bad files are clear errors and the engine keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dynamo.errors import UserError
from dynamo.kv import KvRouter
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions
from harness.lora_gguf import write_lora_gguf
from harness.wait import until
from tests.integration.test_llamacpp_kv import SYSTEM, chat

pytestmark = pytest.mark.timeout(240)
BS = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora")
    return {"strong": write_lora_gguf(d / "strong.gguf", seed=1, scale=4.0),
            "other": write_lora_gguf(d / "other.gguf", seed=2, scale=4.0),
            "zero": write_lora_gguf(d / "zero.gguf", seed=3, scale=0.0)}


async def ask(engine: Any, prompt: list[int], model: str | None = None, max_tokens: int = 8,
              ctx: Context | None = None) -> tuple[list[int], int | None]:
    req = PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=max_tokens),
                              sampling_options=SamplingOptions(temperature=0), eos_token_ids=[2], model=model)
    tokens, cached = [], None
    async for out in engine.generate(req, ctx or Context()):
        if cached is None:
            cached = out.cached_tokens
        tokens += out.token_ids
    return tokens, cached


async def _engine(path: Path, slots: int = 4) -> Any:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(path, context_length=512, args={"n_parallel": slots, "n_threads": 1}, block_size=BS)
    await engine.start()
    return engine


async def test_adapters_change_greedy_output_and_run_beside_the_base_model(gguf, tok, adapters):
    engine = await _engine(gguf)
    try:
        for name, path in adapters.items():
            await engine.load_lora(name, str(path))
        assert engine.lora_adapters() == {n: str(p) for n, p in adapters.items()}
        prompt = chat(tok, "You are helpful.", "What is 2+2?")
        alone = {m: (await ask(engine, prompt, m, 12))[0] for m in (None, "strong", "other", "zero")}
        assert alone["zero"] == alone[None]  # a zero adapter changes nothing
        assert alone["strong"] != alone[None] and alone["other"] != alone[None]
        assert alone["strong"] != alone["other"]
        # all four at once (one adapter group per step, taking turns): each answers as it did alone
        together = await asyncio.gather(*(ask(engine, prompt, m, 12) for m in (None, "strong", "other", "zero")))
        assert [t for t, _ in together] == [alone[m] for m in (None, "strong", "other", "zero")]
        assert engine.scheduler.applied.switches >= 3
    finally:
        await engine.close()


async def test_an_f32_adapter_answers_as_its_f16_twin(gguf, tok, tmp_path):
    """llama-server serves F32 adapters; so do we (their crash was the AMX build's, not theirs).  A mild
    adapter (scale 0.5): a strong one (4.0) turns F16 rounding into another answer from the first token."""
    f16 = write_lora_gguf(tmp_path / "mild-f16.gguf", seed=1, scale=0.5)
    f32 = write_lora_gguf(tmp_path / "mild-f32.gguf", seed=1, scale=0.5, f32=True)
    engine = await _engine(gguf)
    try:
        await engine.load_lora("mild16", str(f16))
        await engine.load_lora("mild32", str(f32))
        prompt = chat(tok, "You are helpful.", "What is 2+2?")
        base, _ = await ask(engine, prompt, None, 16)
        f16_tokens, _ = await ask(engine, prompt, "mild16", 16)
        f32_tokens, _ = await ask(engine, prompt, "mild32", 16)
        assert f32_tokens != base
        # the same weights, rounded to F16 or not: the same start (here they part after 9 tokens)
        assert f32_tokens[:4] == f16_tokens[:4], (f32_tokens, f16_tokens)
    finally:
        await engine.close()


async def test_a_prefix_cached_under_one_adapter_serves_only_that_adapter(gguf, tok, adapters):
    engine = await _engine(gguf)
    router_events: list[dict[str, Any]] = []
    base_router, strong_router = KvRouter(block_size=BS), KvRouter(block_size=BS, lora_name="strong")

    def publish(event: dict[str, Any]) -> None:
        router_events.append(event)
        base_router.apply_event(event)
        strong_router.apply_event(event)

    try:
        engine.attach(5, publish_kv_event=publish, publish_metrics=lambda m: None)
        await engine.load_lora("strong", str(adapters["strong"]))
        await engine.load_lora("other", str(adapters["other"]))
        first = chat(tok, SYSTEM, "What is 2+2?")
        second = chat(tok, SYSTEM, "Name three colors.")
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        _, cached = await ask(engine, first, "strong")
        assert cached == 0
        # the router of the adapter finds its blocks; the base model's router does not
        await until(lambda: strong_router.find_matches(second).get(5, 0) == shared // BS, 5, "the adapter's events")
        assert base_router.find_matches(second) == {}
        # on the worker: neither the base model nor another adapter reuses the adapter's prefix
        assert (await ask(engine, second, None))[1] == 0
        assert (await ask(engine, second, "other"))[1] == 0
        # the adapter itself does
        assert (await ask(engine, second, "strong"))[1] == shared
        # and the base model's own prefix, now cached, counts for the base model only
        assert (await ask(engine, chat(tok, SYSTEM, "Hello?"), None))[1] == shared
    finally:
        await engine.close()


async def test_unloading_lets_a_running_request_finish_and_stops_new_ones(gguf, tok, adapters):
    engine = await _engine(gguf)
    try:
        await engine.load_lora("strong", str(adapters["strong"]))
        prompt = chat(tok, "You are helpful.", "Tell me a long story about a dragon.")
        await ask(engine, prompt, "strong", 40)
        # (from the cache the first run left, as the request below will be: a prefill of another length
        # can round differently and turn a near-tie the other way)
        expected, cached = await ask(engine, prompt, "strong", 40)
        assert cached == len(prompt) - 1
        req = PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=40),
                                  sampling_options=SamplingOptions(temperature=0), eos_token_ids=[2], model="strong")
        stream = engine.generate(req, Context())
        got = list((await anext(stream)).token_ids)  # running
        await engine.unload_lora("strong")
        assert engine.lora_adapters() == {}
        async for out in stream:
            got += out.token_ids
        assert got == expected  # it finished with the adapter
        await until(lambda: not engine.scheduler.retired, 5, "the adapter to be freed")
        with pytest.raises(Exception, match="not loaded"):
            await ask(engine, prompt, "strong")
        with pytest.raises(UserError, match="not loaded"):
            await engine.unload_lora("strong")
        # loaded again under the same name: it works again
        await engine.load_lora("strong", str(adapters["strong"]))
        again, cached = await ask(engine, prompt, "strong", 40)
        assert cached == 0 and again[:8] == expected[:8]  # (the old adapter's caches were dropped)
    finally:
        await engine.close()


async def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(gguf, tok, tmp_path, adapters):
    engine = await _engine(gguf, slots=2)
    cases = {
        "missing": (tmp_path / "nope.gguf", "no such file"),
        "base": (gguf, "not an adapter"),
        "arch": (write_lora_gguf(tmp_path / "qwen.gguf", arch="qwen2"), "architecture"),
        "shape": (write_lora_gguf(tmp_path / "small.gguf", n_in=64), "do not fit this model"),
        "text": (tmp_path / "text.gguf", "not a GGUF file"),
    }
    (tmp_path / "text.gguf").write_text("hello")
    try:
        for name, (path, why) in cases.items():
            with pytest.raises(UserError, match=why):
                await engine.load_lora(name, str(path))
        await engine.load_lora("strong", str(adapters["strong"]))
        with pytest.raises(UserError, match="already loaded"):
            await engine.load_lora("strong", str(adapters["other"]))
        assert list(engine.lora_adapters()) == ["strong"]
        tokens, _ = await ask(engine, chat(tok, "You are helpful.", "What is 2+2?"))
        assert tokens
    finally:
        await engine.close()
