"""KV offloading on llama.cpp (SmolLM2 GGUF): more distinct prefixes than slots, revisited, come back from
the host-memory tier (reported as cached prompt tokens) with the same greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.engines.kv_host_tier import HostKvTier
from tests.integration.test_llamacpp import _smollm2
from tests.integration.test_llamacpp_kv import ask, chat, tok  # noqa: F401 - tok is a fixture

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return _smollm2()


async def _engine(gguf: Path, host_cache_mb: int) -> object:
    from dynamo.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(gguf, context_length=512,
                            args={"n_parallel": 2, "n_threads": 1, "host_cache_mb": host_cache_mb})
    await engine.start()
    return engine


async def test_revisited_prefixes_are_restored_from_the_host_tier(gguf, tok):
    system = "You answer questions about {} in one short sentence, politely and precisely. " * 6
    prompts = [chat(tok, system.replace("{}", topic), "What is it?") for topic in ("cats", "ships", "rain", "bread")]
    engine = await _engine(gguf, 256)
    plain = await _engine(gguf, 0)
    try:
        first = [await ask(engine, p) for p in prompts]  # 4 prefixes, 2 slots: two were overwritten
        assert engine.host_tier.saved >= 2
        again, cached = await ask(engine, prompts[0])
        assert engine.host_tier.restored == 1
        assert cached >= len(prompts[0]) - 16  # the whole prompt but its tail came from the tier
        assert again == first[0][0]
        # without the tier the same sequence recomputes the prefix, with the same answer
        for p in prompts:
            await ask(plain, p)
        again_plain, cached_plain = await ask(plain, prompts[0])
        assert cached_plain < 16 and again_plain == again
    finally:
        await engine.close()
        await plain.close()


def test_host_tier_is_bounded_lru_and_drops_covered_prefixes():
    t = HostKvTier(max_bytes=100)
    t.put([1, 2, 3], b"a" * 40)
    t.put([1, 2, 3, 4], b"b" * 40)  # covers [1, 2, 3]: that one goes
    assert len(t) == 1 and t.bytes == 40
    t.put([5, 6], b"c" * 40)
    t.get((1, 2, 3, 4))  # used: [5, 6] is now the oldest
    t.put([7], b"d" * 40)
    assert t.best([5, 6, 9]) is None and t.best([1, 2, 3, 9]) == ((1, 2, 3, 4), 3) and t.evicted == 1
    assert not t.put([8], b"x" * 101)
