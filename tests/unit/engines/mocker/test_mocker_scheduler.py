"""The mocker's scheduler, driven step by step (no event loop needed): budgets, chunked prefill, prefix
caching, pre-emption, completion and the KV events it produces."""

import itertools

import pytest

from dynamo.engines.mocker.args import MockerArgs
from dynamo.engines.mocker.scheduler import MockRequest, Scheduler, decode_time_ms, prefill_time_ms
from dynamo.errors import EngineError
from dynamo.kv.hashing import compute_hashes

_ids = itertools.count()


def make_sched(**kw):
    events = []
    args = MockerArgs(**{"block_size": 4, **kw})
    s = Scheduler(args, seed=0,
                  on_stored=lambda parent, blocks: events.append(("stored", parent, blocks)),
                  on_removed=lambda hashes: events.append(("removed", hashes)))
    return s, events


def make_req(prompt, max_tokens=4, ctx=None):
    counter = itertools.count(10_000)
    return MockRequest(request_id=f"r{next(_ids)}", tokens=list(prompt), prompt_len=len(prompt),
                       max_tokens=max_tokens, next_token=lambda: next(counter), ctx=ctx)


def prompt(n, base=0):
    return [base + i for i in range(n)]


def drain(req):
    items = []
    while not req.out.empty():
        items.append(req.out.get_nowait())
    return items


def run_until_idle(s, limit=10_000):
    """Step until nothing is left; returns {request: [items]} in delivery order and total ms."""
    got = {}
    total = 0.0
    for _ in range(limit):
        if s.idle:
            return got, total
        ms, out = s.step()
        total += ms
        for req, item in out:
            got.setdefault(req, []).append(item)
    raise AssertionError("scheduler did not finish")


def tokens_of(items):
    return [t for it in items for t in it.token_ids]


class Stopper:
    def __init__(self):
        self.is_stopped = False


def test_timing_formulas():
    assert prefill_time_ms(0) == pytest.approx(26.2)
    assert prefill_time_ms(1000) == pytest.approx(1.25 + 74.1 + 26.2)
    assert decode_time_ms(0) == pytest.approx(19.44)
    assert decode_time_ms(1) == pytest.approx(-5.47 + 43.88 + 19.44)


def test_admission_stops_at_max_num_seqs():
    s, _ = make_sched(max_num_seqs=2)
    reqs = [make_req(prompt(8, 100 * i)) for i in range(5)]
    for r in reqs:
        s.enqueue(r)
    s.step()
    assert s.num_running == 2 and len(s.waiting) == 3
    assert list(s.waiting) == reqs[2:]


def test_admission_stops_at_token_budget_without_chunking():
    s, _ = make_sched(max_num_batched_tokens=100, enable_chunked_prefill=False)
    reqs = [make_req(prompt(60, 1000 * i)) for i in range(3)]
    for r in reqs:
        s.enqueue(r)
    ms, _ = s.step()
    # 60 + 60 > 100: only the first is admitted and prefilled whole
    assert list(s.decode) == [reqs[0]] and list(s.waiting) == reqs[1:]
    assert ms == pytest.approx(prefill_time_ms(60))
    ms, _ = s.step()
    # now one decoding sequence (1 token) + 60 fits, the third does not
    assert list(s.decode) == reqs[:2] and list(s.waiting) == reqs[2:]
    assert ms == pytest.approx(prefill_time_ms(60) + decode_time_ms(s.kv.num_active / s.kv.num_blocks), rel=0.05)


def test_decode_speedup_ratio_shortens_decode_steps_only():
    for ratio in (1.0, 4.0):
        s, _ = make_sched(decode_speedup_ratio=ratio)
        s.enqueue(make_req(prompt(8), max_tokens=3))
        prefill_ms, _ = s.step()  # prefill only: nothing was decoding when the step began
        assert prefill_ms == pytest.approx(prefill_time_ms(8))
        decode_ms, _ = s.step()
        assert decode_ms == pytest.approx(decode_time_ms(s.kv.num_active / s.kv.num_blocks) / ratio)


def test_chunked_prefill_splits_at_the_budget():
    s, _ = make_sched(max_num_batched_tokens=100, enable_chunked_prefill=True)
    reqs = [make_req(prompt(60, 1000 * i)) for i in range(3)]
    for r in reqs:
        s.enqueue(r)
    ms, _ = s.step()
    # admitted while the budget is not yet used up: 60 < 100 lets the second in, 120 stops the third
    assert list(s.decode) == [reqs[0]] and list(s.prefill) == [reqs[1]] and list(s.waiting) == [reqs[2]]
    assert reqs[1].to_prefill == 20  # 40 of its 60 tokens computed this step
    assert ms == pytest.approx(prefill_time_ms(60) + prefill_time_ms(40))
    ms, _ = s.step()
    assert reqs[1] in s.decode and reqs[1].to_prefill == 0


def test_admission_stops_at_block_budget():
    s, _ = make_sched(num_gpu_blocks=10, watermark=0.01)
    reqs = [make_req(prompt(16, 1000 * i), max_tokens=1) for i in range(3)]  # 4 blocks each
    for r in reqs:
        s.enqueue(r)
    s._admit()
    # 4 + 4 <= 9.9 but 12 > 9.9
    assert list(s.prefill) == reqs[:2] and list(s.waiting) == [reqs[2]]


def test_head_request_always_admitted_when_idle():
    s, _ = make_sched(max_num_batched_tokens=10, enable_chunked_prefill=False)
    r = make_req(prompt(30))
    s.enqueue(r)
    ms, _ = s.step()
    assert r in s.decode and ms == pytest.approx(prefill_time_ms(30))


def test_exact_max_tokens_and_release():
    s, events = make_sched(num_gpu_blocks=64)
    r = make_req(prompt(10), max_tokens=7)
    s.enqueue(r)
    got, _ = run_until_idle(s)
    items = got[r]
    assert len(tokens_of(items)) == 7 and len(items) == 7
    assert all(it.finish_reason is None for it in items[:-1]) and items[-1].finish_reason == "length"
    assert s.kv.num_active == 0
    # 17 tokens: 4 full blocks are now cached (inactive), the partial tail was freed
    assert s.kv.num_inactive == 4


def test_prefix_cache_hit_shortens_prefill():
    s, events = make_sched(num_gpu_blocks=64)
    p = prompt(32)
    a = make_req(p, max_tokens=1)
    s.enqueue(a)
    ms_a, _ = s.step()
    assert a.cached_tokens == 0 and ms_a == pytest.approx(prefill_time_ms(32))
    assert s.idle
    b = make_req(p + [777, 778, 779], max_tokens=1)
    s.enqueue(b)
    ms_b, _ = s.step()
    assert b.cached_tokens == 32
    assert ms_b == pytest.approx(prefill_time_ms(3)) and ms_b < ms_a
    assert s.metrics()["kv_stats"]["gpu_prefix_cache_hit_rate"] == pytest.approx((0 + 8 / 9) / 2)


def test_no_prefix_caching_means_no_hits_and_no_events():
    s, events = make_sched(num_gpu_blocks=64, enable_prefix_caching=False)
    for _ in range(2):
        r = make_req(prompt(32), max_tokens=2)
        s.enqueue(r)
        run_until_idle(s)
        assert r.cached_tokens == 0
    assert events == []
    assert s.kv.num_inactive == 0 and s.kv.num_active == 0


def test_stored_events_shape_and_eviction():
    s, events = make_sched(num_gpu_blocks=6, watermark=0.0)
    p = prompt(12)
    local, seq = compute_hashes(p, 4)
    r = make_req(p, max_tokens=4)  # 12 + 4 = 16 tokens: a 4th block promoted during decode
    s.enqueue(r)
    run_until_idle(s)
    assert events[0] == ("stored", None, list(zip(seq, local, strict=True)))
    full_local, full_seq = compute_hashes(r.tokens, 4)
    assert events[1] == ("stored", seq[-1], [(full_seq[3], full_local[3])])
    assert len(events) == 2
    # a new 6-block prompt needs every slot: the 4 cached blocks are evicted, tail first
    r2 = make_req(prompt(24, 500), max_tokens=1)
    s.enqueue(r2)
    s.step()
    removed = [e for e in events if e[0] == "removed"]
    assert removed == [("removed", [full_seq[3], full_seq[2], full_seq[1], full_seq[0]])]


def test_preemption_when_blocks_run_out():
    s, _ = make_sched(num_gpu_blocks=5, watermark=0.0)
    r1 = make_req(prompt(8, 0), max_tokens=8)
    r2 = make_req(prompt(8, 100), max_tokens=8)
    s.enqueue(r1)
    s.enqueue(r2)
    s.step()
    # r1 took 2 blocks + 1 for its first token, r2 2 blocks; r2's first token needs a 6th: r1 (oldest) goes
    assert s.preemptions == 1 and r1.preemptions == 1
    assert list(s.waiting) == [r1] and list(s.decode) == [r2]
    assert len(r1.tokens) == 9  # it keeps what it produced
    got, _ = run_until_idle(s)
    # both finish with exactly max_tokens tokens, nothing sent twice
    assert r1.generated == 8 and r2.generated == 8
    assert len(tokens_of(got[r1])) == 7 and len(tokens_of(got[r2])) == 7  # the first token came in step 1
    assert s.kv.num_active == 0


def test_sequence_that_can_never_fit_fails_cleanly():
    s, _ = make_sched(num_gpu_blocks=3, watermark=0.0)
    big = make_req(prompt(20), max_tokens=2)  # 5 blocks > 3
    s.enqueue(big)
    _, out = s.step()
    assert len(out) == 1 and isinstance(out[0][1], EngineError)
    assert s.idle and s.kv.num_active == 0
    grow = make_req(prompt(12), max_tokens=8)  # fits, but cannot grow past 12 tokens
    s.enqueue(grow)
    got, _ = run_until_idle(s)
    assert isinstance(got[grow][-1], EngineError)
    assert s.kv.num_active == 0


def test_stopped_context_is_cancelled_and_freed():
    s, _ = make_sched(num_gpu_blocks=64)
    ctx = Stopper()
    r = make_req(prompt(10), max_tokens=100, ctx=ctx)
    s.enqueue(r)
    s.step()
    s.step()
    assert s.kv.num_active > 0
    ctx.is_stopped = True
    _, out = s.step()
    assert [(req, item.finish_reason) for req, item in out] == [(r, "cancelled")]
    assert s.idle and s.kv.num_active == 0


def test_runtime_style_context_method():
    class MethodCtx:
        def __init__(self):
            self.flag = False

        def is_stopped(self):
            return self.flag

    s, _ = make_sched()
    ctx = MethodCtx()
    r = make_req(prompt(10), max_tokens=100, ctx=ctx)
    s.enqueue(r)
    s.step()
    ctx.flag = True
    _, out = s.step()
    assert out[0][1].finish_reason == "cancelled"


def test_abandoned_request_dropped_silently():
    s, _ = make_sched()
    r = make_req(prompt(10), max_tokens=100)
    waiting = make_req(prompt(10, 50), max_tokens=100)
    s.enqueue(r)
    s.step()
    s.enqueue(waiting)
    r.cancelled = True
    waiting.cancelled = True
    _, out = s.step()
    assert out == [] and s.idle and s.kv.num_active == 0


def test_metrics_shape():
    s, _ = make_sched(num_gpu_blocks=100, max_num_seqs=1)
    s.enqueue(make_req(prompt(10), max_tokens=5))
    s.enqueue(make_req(prompt(10, 50), max_tokens=5))
    s.step()
    m = s.metrics()
    assert m == {
        "worker_stats": {"data_parallel_rank": 0, "request_active_slots": 1, "request_total_slots": 1,
                         "num_requests_waiting": 1},
        "kv_stats": {"kv_active_blocks": 3, "kv_total_blocks": 100, "gpu_cache_usage_perc": 0.03,
                     "gpu_prefix_cache_hit_rate": 0.0},
        "spec_decode_stats": None,
    }
