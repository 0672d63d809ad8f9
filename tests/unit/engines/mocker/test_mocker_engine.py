"""The mocker engine end to end on an asyncio loop: streams, cancellation, dp ranks, events, metrics,
arguments, and the ``out=mocker`` factory."""

import asyncio
import json

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from dynamo.engines.mocker import DEFAULT_MAX_TOKENS, MockerArgs, MockerEngine
from dynamo.engines.mocker.scheduler import decode_time_ms, prefill_time_ms
from dynamo.engines.registry import create_engine
from dynamo.errors import RequestError, UserError
from dynamo.kv import KvRouter, compute_hashes
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions
from dynamo.run_config import RunConfig
from harness.wait import until

FAST = {"speedup_ratio": 10000.0, "block_size": 4}


def request(tokens, max_tokens=None, **kw):
    return PreprocessedRequest(token_ids=list(tokens), stop_conditions=StopConditions(max_tokens=max_tokens), **kw)


async def collect(engine, req, ctx=None):
    return [item async for item in engine.generate(req, ctx or Context())]


def tokens_of(items):
    return [t for it in items for t in it.token_ids]


@pytest.fixture
async def engine():
    eng = MockerEngine({**FAST, "num_gpu_blocks": 256}, vocab_size=40, special_ids={0, 1, 2}, seed=7)
    await eng.start()
    yield eng
    await eng.close()


# -- arguments -------------------------------------------------------------------------------------
def test_args_defaults_and_validation():
    a = MockerArgs.from_dict(None)
    assert a.to_dict() == {"num_gpu_blocks": 16384, "block_size": 64, "max_num_seqs": 256,
                           "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
                           "enable_chunked_prefill": True, "watermark": 0.01, "speedup_ratio": 1.0,
                           "decode_speedup_ratio": 1.0, "dp_size": 1,
                           "kv_bytes_per_token": 131072, "kv_transfer_bandwidth_gbps": 25.0,
                           "kv_transfer_latency_ms": 1.0}
    assert MockerArgs.from_dict({"speedup_ratio": 5, "dp_size": 2}).speedup_ratio == 5.0
    with pytest.raises(UserError) as e:
        MockerArgs.from_dict({"num_gpu_blocks": 10, "gpu_blocks": 3, "foo": 1})
    msg = str(e.value)
    assert "foo" in msg and "gpu_blocks" in msg
    assert all(k in msg for k in MockerArgs.valid_keys())
    for bad in ({"speedup_ratio": 0}, {"speedup_ratio": -1}, {"decode_speedup_ratio": 0}, {"block_size": 0}, {"watermark": 1.0},
                {"num_gpu_blocks": "10"}, {"enable_prefix_caching": 1}, {"dp_size": 1.5}, {"max_num_seqs": True}):
        with pytest.raises(UserError):
            MockerArgs.from_dict(bad)


# -- streams ---------------------------------------------------------------------------------------
async def test_exactly_max_tokens(engine):
    items = await collect(engine, request(range(3, 20), max_tokens=12))
    toks = tokens_of(items)
    assert len(toks) == 12 and len(items) == 12
    assert items[-1].finish_reason == "length"
    assert all(i.finish_reason is None for i in items[:-1])
    assert all(3 <= t < 40 for t in toks)  # inside the vocabulary, never a special token


async def test_never_emits_eos_or_hidden_stop_ids(engine):
    req = request(range(3, 10), max_tokens=300, eos_token_ids=[5, 6])
    req.stop_conditions.stop_token_ids_hidden = [7]
    toks = tokens_of(await collect(engine, req))
    assert len(toks) == 300 and not {0, 1, 2, 5, 6, 7} & set(toks)


async def test_max_tokens_zero(engine):
    items = await collect(engine, request(range(5), max_tokens=0))
    assert [(i.token_ids, i.finish_reason) for i in items] == [([], "length")]


async def test_default_max_tokens():
    eng = MockerEngine(FAST, vocab_size=40, context_length=30, seed=1)
    try:
        items = await collect(eng, request(range(3, 23)))  # 20 prompt tokens, context 30
        assert len(tokens_of(items)) == 10 and items[-1].finish_reason == "length"
        with pytest.raises(RequestError):
            await collect(eng, request(range(3, 33)))
    finally:
        await eng.close()
    unlimited = MockerEngine(FAST, vocab_size=40)
    assert unlimited._max_tokens(request(range(10)), 10) == DEFAULT_MAX_TOKENS
    long_ctx = MockerEngine(FAST, vocab_size=40, context_length=100_000)
    assert long_ctx._max_tokens(request(range(10)), 10) == DEFAULT_MAX_TOKENS


async def test_many_concurrent_requests(engine):
    results = await asyncio.gather(*[
        collect(engine, request([3 + (i % 5)] * 16 + list(range(3, 3 + i % 7)), max_tokens=5 + i % 4))
        for i in range(60)])
    for i, items in enumerate(results):
        assert len(tokens_of(items)) == 5 + i % 4 and items[-1].finish_reason == "length"
    await asyncio.sleep(0)
    assert engine.schedulers[0].idle and engine.schedulers[0].kv.num_active == 0


async def test_stop_generating_gives_cancelled(engine):
    ctx = Context()
    items = []
    async for item in engine.generate(request(range(3, 20), max_tokens=10_000), ctx):
        items.append(item)
        if len(items) == 3:
            ctx.stop_generating()
    assert items[-1].finish_reason == "cancelled" and items[-1].token_ids == []
    assert 3 <= len(tokens_of(items)) < 10_000
    assert engine.schedulers[0].kv.num_active == 0


async def test_consumer_leaving_frees_the_request(engine):
    gen = engine.generate(request(range(3, 20), max_tokens=10_000), Context())
    n = 0
    async for _ in gen:
        n += 1
        if n == 2:
            break
    await gen.aclose()
    await until(lambda: engine.schedulers[0].idle, 5, "the scheduler to drop the request")
    assert engine.schedulers[0].idle and engine.schedulers[0].kv.num_active == 0


@pytest.mark.parametrize("speedup", [20.0, 0.01])
async def test_simulated_time_is_slept_scaled(speedup):
    """Each step's simulated time, divided by ``speedup_ratio``, is what the scheduler sleeps (less the
    little the step itself took to compute). The sleeps are recorded, not slept."""
    eng = MockerEngine({"speedup_ratio": speedup, "block_size": 4}, vocab_size=40, seed=1)
    slept: list[float] = []

    async def recorded(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    eng.schedulers[0]._sleep = recorded  # the scheduler's sleep hook (its ``sleep=`` argument)
    try:
        await collect(eng, request(range(3, 103), max_tokens=5))
    finally:
        await eng.close()
    sched = eng.schedulers[0]
    # one prefill step (its first token) then 4 decode steps, one sleep each
    expected_ms = prefill_time_ms(100) + 4 * decode_time_ms(0.0)
    assert sched.simulated_ms == pytest.approx(expected_ms, rel=0.01)
    assert len(slept) == sched.steps == 5
    scaled = sched.simulated_ms / speedup / 1000
    assert sum(slept) <= scaled
    if speedup < 1:  # slowed down: seconds of sleep, beside which computing a step is nothing
        assert sum(slept) == pytest.approx(scaled, rel=0.01)


async def test_repeated_prompt_hits_prefix_cache(engine):
    p = list(range(3, 35))  # 8 blocks
    await collect(engine, request(p, max_tokens=1))
    before = engine.schedulers[0].simulated_ms
    await collect(engine, request(p + [9, 9], max_tokens=1))
    second = engine.schedulers[0].simulated_ms - before
    assert second == pytest.approx(prefill_time_ms(2))
    assert engine.load_metrics()["kv_stats"]["gpu_prefix_cache_hit_rate"] > 0.4


# -- events and metrics ----------------------------------------------------------------------------
async def test_kv_events_feed_a_router():
    events, metrics = [], []
    eng = MockerEngine({**FAST, "num_gpu_blocks": 8, "watermark": 0.0}, vocab_size=40, worker_id=0x7AB,
                       publish_kv_event=events.append, publish_metrics=metrics.append, seed=3)
    try:
        p = list(range(3, 19))  # 4 blocks
        await collect(eng, request(p, max_tokens=1))
        local, seq = compute_hashes(p, 4)
        first = events[0]
        assert first["worker_id"] == 0x7AB and set(first["event"]) == {"event_id", "data"}
        assert first["event"]["data"] == {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": s, "tokens_hash": t} for s, t in zip(seq, local, strict=False)]}}
        router = KvRouter(block_size=4, seed=0)
        for e in events:
            assert router.apply_event(json.dumps(e))
        assert router.select(p, [1, 0x7AB]) == (0x7AB, 4)
        # a different 7-block prompt (+1 block for its first token) needs every slot: the cached
        # blocks are evicted and the removed events reach the router
        seen = len(events)
        await collect(eng, request(range(100, 128), max_tokens=1))
        removed = [e for e in events[seen:] if "removed" in e["event"]["data"]]
        # 3 evicted for the prompt's 7 blocks, the 4th for the block of its first token (tail first)
        assert [e["event"]["data"]["removed"]["block_hashes"] for e in removed] == [seq[3:0:-1], seq[:1]]
        for e in events[seen:]:
            assert router.apply_event(e)
        assert router.find_matches(p) == {}
        ids = [e["event"]["event_id"] for e in events]
        assert len(set(ids)) == len(ids)
        # metrics were pushed, wrapped with the worker id, in the ForwardPassMetrics shape
        await asyncio.sleep(0.05)
        assert metrics and metrics[-1]["worker_id"] == 0x7AB
        assert set(metrics[-1]["data"]) == {"worker_stats", "kv_stats", "spec_decode_stats"}
        assert metrics[-1]["data"]["kv_stats"]["kv_active_blocks"] == 0
    finally:
        await eng.close()


async def test_async_publisher_is_awaited():
    got = []

    async def publish(event):
        await asyncio.sleep(0)
        got.append(event)

    eng = MockerEngine(FAST, vocab_size=40, publish_kv_event=publish, seed=3)
    try:
        await collect(eng, request(range(3, 19), max_tokens=1))
        await asyncio.sleep(0.01)
        assert got and "stored" in got[0]["event"]["data"]
    finally:
        await eng.close()


async def test_no_events_without_prefix_caching():
    events = []
    eng = MockerEngine({**FAST, "enable_prefix_caching": False}, vocab_size=40, publish_kv_event=events.append)
    try:
        await collect(eng, request(range(3, 40), max_tokens=10))
        assert events == []
    finally:
        await eng.close()


# -- data parallel ---------------------------------------------------------------------------------
async def test_dp_rank_annotation_and_choice():
    eng = MockerEngine({**FAST, "dp_size": 2}, vocab_size=40, seed=2)
    try:
        p = list(range(3, 23))
        await collect(eng, request(p, max_tokens=2, annotations=["dp_rank:1"]))
        assert eng.schedulers[1].steps > 0 and eng.schedulers[0].steps == 0
        # no annotation: the rank holding the prefix wins
        steps = eng.schedulers[1].steps
        await collect(eng, request(p, max_tokens=2))
        assert eng.schedulers[1].steps > steps and eng.schedulers[0].steps == 0
        with pytest.raises(RequestError):
            await collect(eng, request(p, max_tokens=2, annotations=["dp_rank:2"]))
        with pytest.raises(RequestError):
            await collect(eng, request(p, max_tokens=2, annotations=["dp_rank:x"]))
        assert [m["worker_stats"]["data_parallel_rank"] for m in eng.all_load_metrics()] == [0, 1]
    finally:
        await eng.close()


# -- the out=mocker factory ------------------------------------------------------------------------
def tokenizer_json():
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok.to_str()


def cfg(tmp_path, args=None, block_size=None):
    path = None
    if args is not None:
        path = tmp_path / "mocker.json"
        path.write_text(json.dumps(args))
    return RunConfig(extra_engine_args=path, kv_cache_block_size=block_size)


def test_factory_needs_a_tokenizer(tmp_path):
    with pytest.raises(UserError, match="tokenizer"):
        create_engine("mocker", cfg(tmp_path), ModelCard.placeholder("m"))


def test_factory_vocab_and_block_size(tmp_path):
    card = ModelCard(display_name="m", tokenizer_json=tokenizer_json(), context_length=100)
    eng = create_engine("mocker", cfg(tmp_path), card)
    assert isinstance(eng, MockerEngine) and eng.kind == "core"
    assert eng.vocab_size == 52 and eng.special_ids == {50, 51}
    assert eng.args.block_size == 64 and card.kv_cache_block_size == 64  # the router hashes like the mocker

    card = ModelCard(display_name="m", tokenizer_json=tokenizer_json())
    eng = create_engine("mocker", cfg(tmp_path, {"block_size": 8, "speedup_ratio": 2}), card)
    assert eng.args.block_size == 8 and card.kv_cache_block_size == 8 and eng.args.speedup_ratio == 2.0

    card = ModelCard(display_name="m", tokenizer_json=tokenizer_json(), kv_cache_block_size=32)
    eng = create_engine("mocker", cfg(tmp_path, {}, block_size=32), card)
    assert eng.args.block_size == 32 and card.kv_cache_block_size == 32

    with pytest.raises(UserError, match="valid keys"):
        create_engine("mocker", cfg(tmp_path, {"num_blocks": 3}), ModelCard(display_name="m", tokenizer_json=tokenizer_json()))


async def test_attach_and_runtime_config():
    events = []
    eng = MockerEngine({**FAST, "num_gpu_blocks": 100, "max_num_seqs": 8}, vocab_size=40)
    eng.attach(0xABC, publish_kv_event=events.append)
    assert eng.runtime_config == {"total_kv_blocks": 100, "max_num_seqs": 8, "max_num_batched_tokens": 8192,
                                  "kv_cache_block_size": 4, "dp_size": 1}
    try:
        await collect(eng, request(range(3, 11), max_tokens=1))
        assert events and all(e["worker_id"] == 0xABC for e in events)
    finally:
        await eng.close()


async def test_restart_after_close():
    eng = MockerEngine(FAST, vocab_size=40)
    await collect(eng, request(range(3, 11), max_tokens=2))
    await eng.close()
    items = await collect(eng, request(range(3, 11), max_tokens=3))
    assert len(tokens_of(items)) == 3
    await eng.close()
