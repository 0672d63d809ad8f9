"""The router and workers that lend cached prefixes: a prompt whose prefix a busy worker holds goes to an
idle one that can fetch it, named in the decision; otherwise nothing changes."""

from dynamo.kv.events import kv_event, removed_data, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.router import KvRouter

BS = 4
PROMPT = list(range(1, 41))  # 10 blocks
LENDERS = {1: "10.0.0.1:7001", 2: "10.0.0.2:7002", 3: "10.0.0.3:7003"}


def publish_prefix(router, worker, tokens):
    local, seq = compute_hashes(tokens, router.block_size)
    router.apply_event(kv_event(worker, 1, stored_data(None, list(zip(seq, local, strict=True)))))


def router(**kw) -> KvRouter:
    r = KvRouter(block_size=BS, seed=0, clock=lambda: 0.0, **kw)
    r.lenders.update(LENDERS)
    return r


def keep_decoding(r: KvRouter, worker: int, tag: str = "x") -> None:
    """One request decoding on ``worker`` (24 blocks of decode load), its prefill done."""
    r.select([9000 + i for i in range(96)], [worker], request_id=f"{tag}-decoding")
    r.on_first_token(f"{tag}-decoding")


def keep_busy(r: KvRouter, worker: int, tag: str = "x") -> None:
    """``worker`` decoding one request and with a prefill ahead: 8 prompt tokens of another (2 blocks)."""
    keep_decoding(r, worker, tag)
    r.select([8000 + i for i in range(8)], [worker], request_id=f"{tag}-prefilling")


def test_a_holder_only_decoding_keeps_the_prompts_it_holds():
    """A prompt sent to a worker that is only decoding waits a token per step there; a fetch would cost
    more than that, so nothing is fetched from such a holder."""
    r = router()
    publish_prefix(r, 1, PROMPT[:32])
    keep_decoding(r, 1)
    d = r.select(PROMPT, [1, 2], request_id="new")
    assert d.prefix_source is None
    assert {c.worker_id: c.prefill_tokens for c in r.last_costs}[2] == 40  # no credit for a fetch


def test_a_busy_holder_lends_its_prefix_to_an_idle_worker():
    r = router()
    publish_prefix(r, 1, PROMPT[:32])  # 8 of the 10 blocks on worker 1
    keep_busy(r, 1)
    d = r.select(PROMPT, [1, 2], request_id="new")
    assert d == (2, 0)  # the idle worker, which holds nothing itself
    assert d.prefix_source == ("10.0.0.1:7001", 32)  # fetch the 32 tokens worker 1 holds
    costs = {c.worker_id: c for c in r.last_costs}
    # worker 2 computes 40 - 0.9 * 32 tokens less the 2 blocks it would wait for the holder's step;
    # booked as if only the 8 unfetched ones were left
    assert costs[2].prefill_tokens == 40 - int((0.9 * 8 - 2) * BS)
    assert r.worker_load(2)["active_tokens"] == 40 - 32


def test_an_idle_holder_keeps_its_prefix_and_no_fetch_is_named():
    r = router()
    publish_prefix(r, 1, PROMPT[:32])
    d = r.select(PROMPT, [1, 2, 3], request_id="new")
    assert d == (1, 8) and d.prefix_source is None


def test_the_worker_holding_less_fetches_only_the_difference_worth_a_trip():
    r = router()
    publish_prefix(r, 1, PROMPT[:32])
    publish_prefix(r, 2, PROMPT[:28])  # one block short of worker 1: not worth a fetch
    keep_busy(r, 1)
    d = r.select(PROMPT, [1, 2])
    assert d == (2, 7) and d.prefix_source is None
    publish_prefix(r, 3, PROMPT[:16])  # 4 blocks: 4 to fetch from worker 1
    keep_busy(r, 2, "y")
    d = r.select(PROMPT, [1, 2, 3])
    assert d == (3, 4) and d.prefix_source == ("10.0.0.1:7001", 32)


def test_only_workers_that_lend_are_credited_or_named():
    r = router()
    del r.lenders[2]  # worker 2's engine cannot fetch (another engine, or sharing turned off)
    publish_prefix(r, 1, PROMPT[:32])
    keep_busy(r, 1)
    costs_seen = r.select(PROMPT, [1, 2])
    assert costs_seen.prefix_source is None
    assert {c.worker_id: c.prefill_tokens for c in r.last_costs}[2] == 40  # no credit: it computes it all
    r.remove_worker(3)
    assert 3 not in r.lenders


def test_weight_zero_turns_fetching_off():
    r = router(prefix_fetch_weight=0.0)
    publish_prefix(r, 1, PROMPT[:32])
    keep_busy(r, 1)
    d = r.select(PROMPT, [1, 2])
    assert d.prefix_source is None
    assert {c.worker_id: c.prefill_tokens for c in r.last_costs}[2] == 40


def test_the_decision_log_names_the_source(tmp_path):
    import json

    from dynamo.kv.decision_log import DecisionLog

    path = tmp_path / "decisions.jsonl"
    r = router(decision_log=DecisionLog(path))
    publish_prefix(r, 1, PROMPT[:32])
    keep_busy(r, 1)
    r.select(PROMPT, [1, 2], request_id="new")
    r.decision_log.close()
    routes = [x for x in map(json.loads, path.read_text().splitlines()) if x["ev"] == "route" and x["id"] == "new"]
    assert routes[0]["worker"] == "2" and routes[0]["fetch"] == {"from": "1", "blocks": 8}


def test_a_holder_in_the_middle_of_a_long_prefill_lends_only_after_it():
    """The holder exports between two steps: while it computes a long prompt, a fetch waits for that
    step, so the credit shrinks by what is left of it and the fetch loses to computing the prompt."""
    now = [0.0]
    r = KvRouter(block_size=BS, seed=0, clock=lambda: now[0])
    r.lenders.update(LENDERS)
    publish_prefix(r, 1, PROMPT[:32])
    r.select([5000 + i for i in range(400)], [1], request_id="long")  # 400 tokens to prefill on worker 1
    d = r.select(PROMPT, [1, 2, 3])
    assert d.worker_id in (2, 3) and d.prefix_source is None  # 0.9 * 8 blocks - 100 blocks of wait: no credit
    r.on_first_token("long")  # its prefill is done: the holder is between steps again, only decoding
    assert r.select(PROMPT, [1, 2, 3]).prefix_source is None  # (it keeps its prompts)
    r.select([7000 + i for i in range(8)], [1], request_id="short")  # a short prefill ahead there
    d = r.select(PROMPT, [2, 3])
    assert d.prefix_source == ("10.0.0.1:7001", 32)


def test_a_holder_in_a_long_prefill_lends_at_once_what_its_host_memory_holds():
    """A lender keeps each finished sequence in its host tier and serves a fetch of it from there without
    waiting for its step: the same holder, in the same long prefill, then lends the prefix."""
    from dynamo.kv.events import HOST

    now = [0.0]
    r = KvRouter(block_size=BS, seed=0, clock=lambda: now[0])
    r.lenders.update(LENDERS)
    local, seq = compute_hashes(PROMPT[:32], BS)
    publish_prefix(r, 1, PROMPT[:32])  # in its cache (the finished turn's slot) ...
    r.select([5000 + i for i in range(400)], [1], request_id="long")
    assert r.select(PROMPT, [1, 2, 3]).prefix_source is None  # (the step's wait, as above)
    r.apply_event(kv_event(1, 2, stored_data(None, list(zip(seq, local, strict=True))), HOST))  # ... and its host tier
    d = r.select(PROMPT, [1, 2, 3])
    assert d.worker_id in (2, 3) and d.prefix_source == ("10.0.0.1:7001", 32)
    # the host tier holding only part of what the cache holds: the rest would wait for the step
    r.apply_event(kv_event(1, 3, removed_data([seq[-1]]), HOST))
    assert r.select(PROMPT, [1, 2, 3]).prefix_source is None


def test_a_prefix_the_chosen_worker_is_computing_already_is_not_fetched():
    r = router()
    publish_prefix(r, 1, PROMPT[:32])
    keep_busy(r, 1)
    first = r.select(PROMPT, [1, 2], request_id="a")
    assert first == (2, 0) and first.prefix_source is not None
    # the same prompt again, while worker 2 is still prefilling it: it will hold it without a fetch
    second = r.select(PROMPT, [2], request_id="b")
    assert second.worker_id == 2 and second.prefix_source is None


def test_a_prefix_in_the_holders_host_memory_is_fetched_at_that_tiers_price():
    """A holder lends from its host-memory tier too, but a fetch of those blocks is never cheaper than the
    holder restoring them itself: an idle holder keeps its prompt, a busy one lends it."""
    from dynamo.kv.events import HOST

    r = router()
    local, seq = compute_hashes(PROMPT[:32], BS)
    r.apply_event(kv_event(1, 1, stored_data(None, list(zip(seq, local, strict=True))), HOST))
    d = r.select(PROMPT, [1, 2])
    assert d == (1, 0) and d.prefix_source is None  # 0.8 * 8 restored at home beats 0.72 * 8 fetched
    keep_busy(r, 1)
    d = r.select(PROMPT, [1, 2])
    assert d.worker_id == 2 and d.prefix_source == ("10.0.0.1:7001", 32)
    assert {c.worker_id: c.prefill_tokens for c in r.last_costs}[2] == 40 - int(0.9 * 0.8 * 8 * BS)


def test_the_frontend_puts_the_source_on_the_request_and_a_retry_never_reuses_a_stale_one():
    """The KV policy names the holder in the request it sends; a migration retry of the same request,
    routed where no fetch is named, goes without the first decision's source."""
    from types import SimpleNamespace

    from dynamo.frontend.kv_policy import KvRouterPolicy
    from dynamo.llm.protocols.common import PreprocessedRequest

    r = router()
    publish_prefix(r, 1, PROMPT[:32])
    keep_busy(r, 1)
    policy = KvRouterPolicy(r, events=None)
    sent: list[dict] = []
    candidates = [1, 2]
    client = SimpleNamespace(free_instance_ids=lambda: candidates, instance_ids=lambda: candidates,
                             direct=lambda body, worker, context=None: sent.append(body) or worker)
    request = PreprocessedRequest(token_ids=list(PROMPT), model="m")
    assert policy.open(client, request, SimpleNamespace(id=lambda: "r1")) == 2
    assert sent[-1]["prefix_source"] == {"address": "10.0.0.1:7001", "tokens": 32}
    candidates = [1]  # the retry (worker 2 died): only the holder is left, which needs no fetch
    assert policy.open(client, request, SimpleNamespace(id=lambda: "r1")) == 1
    assert sent[-1]["prefix_source"] is None
