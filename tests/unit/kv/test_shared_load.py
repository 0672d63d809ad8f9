"""A LoRA adapter's KV router shares its base model's bookings per worker: a worker busy with the
adapter's requests costs more for the base model's requests (and the other way round), while each keeps
its own prefix index; peers' events reach the shared bookings once; an adapter leaving a worker leaves
the base model's requests there booked."""

import orjson
import pytest

from dynamo.kv import KvRouter
from dynamo.kv.events import kv_event, stored_data
from dynamo.kv.hashing import compute_hashes

A, B = 0xA, 0xB
PROMPT = list(range(1, 65))  # four blocks of 16


def pair() -> tuple[KvRouter, KvRouter]:
    base = KvRouter(block_size=16, seed=0)
    return base, KvRouter(block_size=16, seed=0, lora_name="sql", load_of=base)


def test_a_worker_busy_with_adapter_requests_costs_more_for_the_base_model_and_the_other_way_round():
    base, sql = pair()
    first = sql.select(PROMPT, [A, B], request_id="s1")
    busy, idle = first.worker_id, ({A, B} - {first.worker_id}).pop()
    # the base model's router sees the adapter's request: the busy worker costs more, so the idle one wins
    assert base.select(PROMPT, [A, B], request_id="b1").worker_id == idle
    costs = {c.worker_id: c for c in base.last_costs}
    assert costs[busy].logit > costs[idle].logit
    assert base.worker_load(busy) == sql.worker_load(busy) == {
        "active_blocks": 4, "active_tokens": 64, "active_requests": 1}
    for rid, router in (("s1", sql), ("b1", base)):
        router.on_finished(rid)
    assert base.worker_load(A)["active_requests"] == sql.worker_load(B)["active_requests"] == 0
    # vice versa: a worker busy with the base model's request costs more for the adapter
    busy = base.select(PROMPT, [A, B], request_id="b2").worker_id
    assert sql.select(PROMPT, [A, B], request_id="s2").worker_id != busy


def test_routers_that_do_not_share_see_an_idle_worker_where_the_adapter_is_busy():
    """What sharing changes: on its own, the base model's router sees both workers equally idle."""
    base, sql = KvRouter(block_size=16, seed=0), KvRouter(block_size=16, seed=0, lora_name="sql")
    busy = sql.select(PROMPT, [A, B], request_id="s1").worker_id
    base.select(PROMPT, [A, B])
    costs = {c.worker_id: c.logit for c in base.last_costs}
    assert costs[A] == costs[B] and base.worker_load(busy)["active_requests"] == 0


def test_each_router_keeps_its_own_prefix_index():
    base, sql = pair()
    local, seq = compute_hashes(PROMPT, 16, "sql")
    sql.apply_event(kv_event(A, 1, stored_data(None, list(zip(seq, local, strict=True)))))
    assert sql.find_matches(PROMPT).get(A) == 4
    assert base.find_matches(PROMPT).get(A) is None
    # the cached adapter prefix wins for the adapter; the base model's router knows nothing of it
    assert sql.select(PROMPT, [A, B]).worker_id == A


def test_a_peers_bookings_reach_the_shared_bookings_once_and_siblings_echoes_are_ignored():
    base, sql = pair()
    assert sql.router_id == base.router_id
    sent: list[dict] = []
    sql.publish_active_sequence = sent.append
    sql.select(PROMPT, [A], request_id="s1")
    # our own adapter router's event, as the base router's subscription would hear it: an echo
    assert base.apply_active_sequence_event(orjson.dumps(sent[0])) is False
    assert base.worker_load(A)["active_requests"] == 1
    peer = {"events": [{"request_id": "p1", "worker": {"worker_id": B, "dp_rank": 0}, "router_id": 7, "lora_name": None,
                        "data": {"AddRequest": {"token_sequence": [1, 2], "track_prefill_tokens": True,
                                                "expected_output_tokens": None, "prefill_load_hint": {
                                                    "initial_effective_prefill_tokens": 32,
                                                    "expected_prefill_duration": None}}}}]}
    assert base.apply_active_sequence_event(peer)
    assert sql.worker_load(B) == {"active_blocks": 2, "active_tokens": 32, "active_requests": 1}


def test_an_adapter_leaving_a_worker_leaves_the_base_models_requests_booked():
    base, sql = pair()
    base.select(PROMPT, [A], request_id="b1")
    sql.select(PROMPT, [A], request_id="s1")
    sql.remove_worker(A)  # the adapter was unloaded from A; A still serves the base model
    assert base.worker_load(A)["active_requests"] == 2
    sql.on_finished("s1")
    assert base.worker_load(A)["active_requests"] == 1
    base.remove_worker(A)  # the worker itself left
    assert base.worker_load(A)["active_requests"] == sql.worker_load(A)["active_requests"] == 0


def test_sharing_needs_the_same_block_size_and_weight():
    base = KvRouter(block_size=16)
    with pytest.raises(ValueError, match="same block size"):
        KvRouter(block_size=32, load_of=base)
