"""KV offloading on llama.cpp (SmolLM2 GGUF): more distinct prefixes than slots, revisited, come back from
the host-memory tier (reported as cached prompt tokens) with the same greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.engines.llamacpp.host_tier import HostKvTier
from harness.wait import until
from tests.integration.test_llamacpp_kv import ask, chat

pytestmark = pytest.mark.timeout(240)


async def _engine(gguf: Path, host_cache_mb: int) -> object:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

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
        assert engine.caches.host_tier.saved >= 2
        again, cached = await ask(engine, prompts[0])
        assert engine.caches.host_tier.restored == 1
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


def _holding(store, prompt: list[int]) -> tuple[int, ...] | None:
    """The key of ``store`` (host or disk tier) that holds ``prompt``, if any."""
    return next((k for k in store.keys() if k[:len(prompt)] == tuple(prompt)), None)


async def test_more_prefixes_than_slots_and_host_memory_come_back_from_disk(gguf, tok, tmp_path):
    from dynamo.engines.llamacpp.engine import LlamaCppEngine
    from dynamo.kv import KvRouter
    from dynamo.kv.events import DISK, HOST

    system = "You answer questions about {} in one short sentence, politely and precisely. " * 6
    prompts = [chat(tok, system.replace("{}", topic), "What is it?") for topic in ("cats", "ships", "rain", "bread")]
    # host memory for one saved prefix only: the next one pushes it to disk
    one_entry_mb = max(len(p) for p in prompts) * 23_100 * 1.5 / (1 << 20)
    engine = LlamaCppEngine(gguf, context_length=512, block_size=16, args={
        "n_parallel": 2, "n_threads": 1, "host_cache_mb": one_entry_mb, "disk_cache_mb": 64,
        "disk_cache_dir": str(tmp_path)})
    await engine.start()
    router = KvRouter(block_size=16)
    applied: list[bool] = []  # the router is fed the engine's events as they come

    engine.attach(0x5EED, publish_kv_event=lambda e: applied.append(router.apply_event(e)))
    try:
        first = [await ask(engine, p) for p in prompts]
        assert len(engine.caches.host_tier) == 1 and len(engine.caches.disk_tier) >= 1
        on_disk = [i for i, p in enumerate(prompts) if _holding(engine.caches.disk_tier, p)]
        (in_host,) = [i for i, p in enumerate(prompts) if _holding(engine.caches.host_tier, p)]
        # the router was told where each prefix is: resident (the last one), restorable from host memory,
        # from disk (the scheduler thread's last events reach the loop after the answers)
        wid = 0x5EED

        def told() -> bool:
            return (router.find_matches(prompts[3]) == {wid: len(prompts[3]) // 16}
                    and router.restorable(prompts[in_host]) == {
                        wid: pytest.approx(router.tier_weights[HOST] * (len(prompts[in_host]) // 16))}
                    and all(router.restorable(prompts[i]) == {
                        wid: pytest.approx(router.tier_weights[DISK] * (len(prompts[i]) // 16))} for i in on_disk))

        await until(told, 10, "the router to know where each prefix is")
        assert applied and all(applied)  # every event was understood
        again, cached = await ask(engine, prompts[on_disk[0]])
        assert engine.caches.disk_tier.restored == 1 and cached >= len(prompts[on_disk[0]]) - 16
        assert again == first[on_disk[0]][0]
        assert _holding(engine.caches.host_tier, prompts[on_disk[0]])  # promoted back to host memory
        # a damaged file falls back to computing the prompt, with the same answer
        victim = next(i for i, p in enumerate(prompts) if _holding(engine.caches.disk_tier, p) and i != 3)
        path = engine.caches.disk_tier.path_of(_holding(engine.caches.disk_tier, prompts[victim]))
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x55
        path.write_bytes(blob)
        again1, cached1 = await ask(engine, prompts[victim])
        assert engine.caches.disk_tier.corrupt == 1 and cached1 < 16 and again1 == first[victim][0]
        assert engine.caches.disk_tier.restored == 1 and not path.exists()
    finally:
        await engine.close()
    assert list(tmp_path.iterdir()) == []  # the tier's files go with the engine
