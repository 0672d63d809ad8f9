"""The sizing math, the online capacity and the hysteresis, and how the planner sizes pools from them."""

from __future__ import annotations

import pytest

from dynamo.planner.connector import FleetState, PoolState
from dynamo.planner.observe import Observation
from dynamo.planner.planner import PlannerConfig, size_pools
from dynamo.planner.sizing import (
    Hysteresis,
    Load,
    OnlineCapacity,
    clamp_pools,
    decode_demand,
    load_at_target,
    prefill_demand,
    reactive_workers,
    workers_for,
)


def test_prefill_and_decode_demand():
    load = Load(request_rate=10.0, isl=1000.0, osl=200.0)
    assert prefill_demand(load, 4000.0) == pytest.approx(2.5)  # 10k prompt tok/s over 4k per worker
    # 10 req/s * 200 tokens * 0.05 s = 100 streams at once; 40 per worker
    assert decode_demand(load, 50.0, 40.0) == pytest.approx(2.5)
    assert workers_for(2.5) == 3 and workers_for(2.0000001) == 2 and workers_for(0.0) == 0


def test_clamp_pools():
    assert clamp_pools(0, 0, 1, None, True) == (1, 1)
    assert clamp_pools(6, 2, 1, 4, True) == (3, 1)  # over budget: cut in proportion
    assert clamp_pools(9, 1, 1, 4, True) == (3, 1)  # never below the minimum
    assert clamp_pools(5, 9, 1, 4, False) == (0, 4)  # aggregated: one pool
    assert clamp_pools(0, 0, 2, 10, False) == (0, 2)


def test_online_capacity_fits_a_line():
    cap = OnlineCapacity()
    for streams in (2.0, 4.0, 8.0):
        cap.observe_decode(streams, 20.0 + 5.0 * streams)  # ITL = 20 + 5 * streams
    assert cap.decode_concurrency(50.0) == pytest.approx(6.0)
    assert cap.prefill_tok_s(500.0, 100.0) is None  # nothing seen


def test_online_capacity_flat_latency_uses_proven_load():
    assert load_at_target([(3.0, 10.0), (3.1, 10.0), (5.0, 10.0)], 50.0) == 5.0
    assert load_at_target([(3.0, 90.0)], 50.0) is None


def test_reactive_workers():
    assert reactive_workers(2, None, 50.0) == 2
    assert reactive_workers(2, 40.0, 50.0) == 2  # under the target: hold
    assert reactive_workers(2, 150.0, 50.0) == 6  # three times over: three times the workers
    assert reactive_workers(2, 55.0, 50.0) == 3  # at least one more


def test_hysteresis_up_at_once_down_after_k():
    h = Hysteresis(down_after=3)
    assert h.step(2, 4) == 4
    assert h.step(4, 1) == 4
    assert h.step(4, 2) == 4
    assert h.step(4, 4) == 4  # the run is broken
    assert [h.step(4, d) for d in (1, 2, 1)] == [4, 4, 2]  # down to the most any of the three wanted


def obs(**kw) -> Observation:
    base = dict(seconds=1.0, arrivals=10.0, completed=10.0, isl=100.0, osl=50.0, ttft_ms=100.0, itl_ms=10.0,
                inflight=5.0, waiting=0.0, kv_usage=None, frontends=1)
    base.update(kw)
    return Observation(**base)


class Known:
    def prefill_tok_s(self, ttft_ms: float, isl: float) -> float:
        return 1000.0

    def decode_concurrency(self, itl_ms: float) -> float:
        return 10.0


def fleet(p: int, d: int) -> FleetState:
    return FleetState(PoolState(ready=p), PoolState(ready=d))


def test_size_pools_disaggregated_from_capacity():
    cfg = PlannerConfig(namespace="n", prefill_cmd="x", ttft_ms=500.0, itl_ms=50.0, max_workers=None)
    # 10 req/s * 500 tokens = 5000 tok/s / 1000 = 5 prefill; 10 * 100 * .05 = 50 streams / 10 = 5 decode
    d = size_pools(Load(10.0, 500.0, 100.0), obs(), fleet(1, 1), Known(), cfg, additive=True)
    assert (d.prefill, d.decode) == (5, 5)


def test_size_pools_aggregated_adds_shares_and_clamps():
    cfg = PlannerConfig(namespace="n", ttft_ms=500.0, itl_ms=50.0, max_workers=8)
    d = size_pools(Load(10.0, 500.0, 100.0), obs(), fleet(0, 1), Known(), cfg, additive=True)
    assert (d.prefill, d.decode) == (0, 8)  # 5 + 5 wanted, the budget is 8
    d = size_pools(Load(1.0, 500.0, 100.0), obs(), fleet(0, 1), Known(), cfg, additive=False)
    assert d.decode == 1


def test_size_pools_without_capacity_reacts_to_latency():
    cfg = PlannerConfig(namespace="n", ttft_ms=500.0, itl_ms=50.0, max_workers=10)
    d = size_pools(Load(5.0, 100.0, 50.0), obs(itl_ms=200.0), fleet(0, 2), OnlineCapacity(), cfg, additive=False)
    assert d.decode == 8 and "ITL 200 ms over 50 ms" in d.reason
    d = size_pools(Load(5.0, 100.0, 50.0), obs(itl_ms=20.0), fleet(0, 2), OnlineCapacity(), cfg, additive=False)
    assert d.decode == 2  # capacity unknown and within the targets: hold
    d = size_pools(Load(0.0, 100.0, 50.0), obs(inflight=0.0), fleet(0, 3), OnlineCapacity(), cfg, additive=False)
    assert d.decode == 1 and d.reason == "no load"
