"""The KV router's overlap weight: the operator's flag, else what the workers' engine suggests, else 2.0."""

from __future__ import annotations

import logging

import pytest

from dynamo.engines.llamacpp.engine import ROUTER_OVERLAP_WEIGHT
from dynamo.frontend.kv_policy import DEFAULT_OVERLAP_WEIGHT, KvRouterPolicy, overlap_weight
from dynamo.frontend.remote import RouterConfig
from dynamo.kv.events import kv_event, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.router import KvRouter
from dynamo.llm.model_entry import SUGGESTED_OVERLAP_WEIGHT, ModelEntry
from dynamo.llm.model_type import ModelType

BS = 16


def entry(runtime_config: dict | None, instance_id: int = 1) -> ModelEntry:
    return ModelEntry(name="m", namespace="ns", component="backend", endpoint="generate",
                      model_type=ModelType.parse("chat"), instance_id=instance_id, card={},
                      runtime_config=runtime_config)


def test_the_operators_flag_wins_over_the_engines_suggestion():
    cfg = RouterConfig(mode="kv", kv_overlap_score_weight=1.0)
    assert overlap_weight(cfg, entry({SUGGESTED_OVERLAP_WEIGHT: 6.0})) == (1.0, "--kv-overlap-score-weight")
    # 0 is a weight the operator may choose (load only), not "unset"
    cfg = RouterConfig(mode="kv", kv_overlap_score_weight=0.0)
    assert overlap_weight(cfg, entry({SUGGESTED_OVERLAP_WEIGHT: 6.0}))[0] == 0.0


def test_without_a_flag_the_engines_suggestion_is_used_else_the_default():
    cfg = RouterConfig(mode="kv")
    assert overlap_weight(cfg, entry({SUGGESTED_OVERLAP_WEIGHT: ROUTER_OVERLAP_WEIGHT}))[0] == ROUTER_OVERLAP_WEIGHT
    # the mocker and the Python engines suggest nothing: the default chosen on mocker fleets
    assert overlap_weight(cfg, entry({"total_kv_blocks": 100})) == (DEFAULT_OVERLAP_WEIGHT, "default")
    assert overlap_weight(cfg, entry(None)) == (DEFAULT_OVERLAP_WEIGHT, "default")


@pytest.mark.parametrize("bad", ["heavy", -1, float("nan"), float("inf"), [6]])
def test_a_suggestion_that_is_not_a_weight_is_logged_and_the_default_used(bad, caplog):
    caplog.set_level(logging.WARNING, logger="dynamo.frontend.kv_policy")
    assert overlap_weight(RouterConfig(mode="kv"), entry({SUGGESTED_OVERLAP_WEIGHT: bad}))[0] == DEFAULT_OVERLAP_WEIGHT
    assert "suggests overlap weight" in caplog.text


def test_llamacpps_weight_keeps_a_conversation_on_the_worker_holding_it_while_that_one_decodes():
    """Worker A holds a conversation's 20-block history and is decoding another request of 40 blocks; B
    is idle.  At 2.0 the decode load outweighs recomputing the history and the turn goes to B (on llama.cpp:
    about half a second of prefill on a CPU core, where A's neighbour costs a few decode steps); at the
    weight llama.cpp workers suggest it stays on A."""
    history = list(range(1000, 1000 + 20 * BS))
    turn = history + list(range(5000, 5000 + 2 * BS))
    other = list(range(9000, 9000 + 40 * BS))

    def pick(weight: float) -> int:
        router = KvRouter(block_size=BS, overlap_score_weight=weight, prefix_homes=False, seed=0, clock=lambda: 0.0)
        local, seq = compute_hashes(history, BS)
        router.apply_event(kv_event(0xA, 1, stored_data(None, list(zip(seq, local, strict=True)))))
        router.select(other, [0xA], request_id="decoding")
        router.on_first_token("decoding")
        return router.select(turn, [0xA, 0xB], request_id="turn").worker_id

    assert pick(DEFAULT_OVERLAP_WEIGHT) == 0xB
    assert pick(ROUTER_OVERLAP_WEIGHT) == 0xA


def test_a_worker_whose_engine_suggests_another_weight_is_named_once(caplog):
    """The router is made with the first worker's suggestion; a worker of another engine (or a llama.cpp
    worker with its layers on a GPU) joining the model is told of, once, since it is routed at that weight."""
    caplog.set_level(logging.WARNING, logger="dynamo.frontend.kv_policy")
    llamacpp = {SUGGESTED_OVERLAP_WEIGHT: ROUTER_OVERLAP_WEIGHT}
    policy = KvRouterPolicy(KvRouter(block_size=BS, overlap_score_weight=ROUTER_OVERLAP_WEIGHT), events=None,
                            weight_from_workers=True)
    policy.add_worker(entry(llamacpp, 1))
    policy.add_worker(entry(llamacpp, 2))
    assert "suggests overlap weight" not in caplog.text
    policy.add_worker(entry({}, 3))
    policy.add_worker(entry({}, 4))
    assert caplog.text.count("worker 3's engine suggests overlap weight 2 but the router weighs 6") == 1
    assert "worker 4" not in caplog.text
    # with the operator's weight, the workers' suggestions do not matter
    caplog.clear()
    policy = KvRouterPolicy(KvRouter(block_size=BS, overlap_score_weight=3.0), events=None)
    policy.add_worker(entry(llamacpp, 1))
    policy.add_worker(entry({}, 2))
    assert "overlap weight" not in caplog.text
