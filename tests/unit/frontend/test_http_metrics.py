"""The frontend's inter-token latency histogram: binned per request, the same counts and sum as one
``observe`` per token."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from dynamo.frontend.http import metrics as metrics_mod
from dynamo.frontend.http.metrics import ITL_FLUSH_EVERY, FrontendMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _itl_samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        if family.name == name:
            for s in family.samples:
                if s.name.endswith(("_bucket", "_count", "_sum")):
                    out[(s.name.removeprefix(name), s.labels.get("le", ""))] = s.value
    return out


def test_itl_histogram_matches_one_observe_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(metrics_mod.time, "monotonic", clock)
    m = FrontendMetrics(prefix="t")
    ref_registry = CollectorRegistry()
    ref = Histogram("t_inter_token_latency_seconds", "ref", ["model"], registry=ref_registry,
                    buckets=tuple(b for b in m.itl._upper_bounds if b != float("inf"))).labels("m")

    rm = m.request("M", "chat_completions", True)
    # gaps on bucket bounds, between them, past the last one, and several tokens in one chunk
    steps = [(1, 0.0), (1, 0.001), (1, 0.0035), (2, 0.02), (1, 0.015), (3, 0.3), (1, 5.0)] * 30
    clock.now += 0.2  # time to first token
    rm.tokens(1, 7)
    total = 1
    for new, gap in steps:
        before = clock.now
        clock.now += gap * new
        total += new
        rm.tokens(total, 7)
        for _ in range(new):
            ref.observe((clock.now - before) / new)  # the gap as the clock's floats give it
    got_mid = _itl_samples(m.registry, "t_inter_token_latency_seconds")
    assert got_mid[("_count", "")] <= sum(n for n, _ in steps)  # some still binned locally
    assert sum(n for n, _ in steps) - got_mid[("_count", "")] < ITL_FLUSH_EVERY
    rm.done(True)

    got = _itl_samples(m.registry, "t_inter_token_latency_seconds")
    want = _itl_samples(ref_registry, "t_inter_token_latency_seconds")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key]), key
    assert got[("_count", "")] == sum(n for n, _ in steps)


def test_queued_requests_counts_until_the_first_token() -> None:
    """Dynamo's queued_requests: a request counts from its start to its first token (or its end)."""
    m = FrontendMetrics(prefix="t")
    queued = m.queued.labels("m")
    a = m.request("M", "chat_completions", True)
    b = m.request("M", "chat_completions", True)
    assert queued._value.get() == 2
    a.tokens(1, 5)
    assert queued._value.get() == 1
    a.tokens(3, 5)  # later tokens change nothing
    a.done(True)
    assert queued._value.get() == 1
    b.done(False)  # failed before any token
    assert queued._value.get() == 0
