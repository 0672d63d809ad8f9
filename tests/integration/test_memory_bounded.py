"""A kv-routed frontend under load keeps no state per request once the requests are done, and its caches
stay within their bounds (a frontend's RSS once rose 59 -> 115 MB in 900 s of unique prompts).

The short form of benchmarks/soak.py: the same fleet (file discovery, 2 mocker workers, a ``--router-mode
kv`` frontend; harness/soak.py) and the same mix (unique prompts, streams, unary, clients that drop after
the first token, n=2, Responses and Anthropic routes), for a bounded number of requests after a warm-up.
The frontend runs with ``DYN_DEBUG_MEMORY=1`` and small caps on its caches, so that the warm-up fills them;
then, reading ``/debug/memory`` before and after the measured requests (each after a full collection):

* every per-request structure (the router's bookings, the HTTP in-flight sets, the runtime's streams) is
  back to 0 once the requests are done, dropped ones included;
* every cache is within its cap, and the KV index holds no more blocks than the workers can (it shrinks
  with their ``removed`` events: the mocker evicts);
* the count of live Python objects grew by less than 0.1 per request: a structure that keeps one dict
  (or any object) per request, named or not, fails it.

No timing is asserted; the RSS slope is the benchmark's to measure (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness.soak import MOCKER_ARGS, debug_memory, kv_fleet, mixed_load
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(240)

WARMUP = 2000
MEASURED = 4000
CAPS = {"DYN_DEBUG_MEMORY": "1", "DYN_ROUTER_PREFIX_HOMES_SIZE": "2000", "DYN_SEGMENT_CACHE_MB": "0.25",
        "DYN_RESPONSES_STORE_SIZE": "50"}
PER_REQUEST = ("kv_router_requests", "kv_router_tracked_requests", "kv_router_peer_requests",
               "kv_router_request_heads", "kv_router_resync_events", "kv_policy_tracked_requests",
               "kv_policy_prepared_hashes", "http_requests_in_flight", "http_contexts_in_flight", "client_streams",
               "client_capacity_waiters", "response_streams_pending", "response_streams_live",
               "response_streams_mux")


def idle_memory(fe) -> dict:
    """/debug/memory once no request is in flight on the frontend (dropped ones finish after the client)."""
    return wait_until(lambda: (m := debug_memory(fe)) and m["structures"].get("http_requests_in_flight") == 0
                      and m["structures"].get("kv_router_requests") == 0 and m, 30,
                      "the frontend to finish every request", interval=0.5)


def test_per_request_state_returns_to_baseline_and_caches_stay_bounded(tiny_model: Path, tmp_path: Path):
    with kv_fleet(tiny_model, tmp_path, frontend_env=CAPS) as fleet:
        fe = fleet.frontend
        warm = asyncio.run(mixed_load(fe.base_url, clients=16, requests=WARMUP, seed=1))
        assert warm.failed == 0, warm.failures[:5]
        before = idle_memory(fe)
        load = asyncio.run(mixed_load(fe.base_url, clients=16, requests=MEASURED, seed=2))
        assert load.failed == 0, load.failures[:5]
        assert load.by_kind.get("drop", 0) > 100 and load.by_kind.get("responses", 0) > 50
        after = idle_memory(fe)

    sizes = after["structures"]
    for name in PER_REQUEST:
        assert sizes.get(name) == 0, (name, sizes)
        assert before["structures"].get(name) == 0, (name, before["structures"])
    assert 0 < sizes["kv_prefix_homes"] <= 2000
    assert 0 < sizes["segment_cache_bytes"] <= 0.25 * 2**20
    assert 0 < sizes["responses_store_entries"] <= 50
    # the index follows the workers' evictions: never more than they hold (each has num_gpu_blocks)
    assert 0 < sizes["kv_index_blocks"] <= 2 * MOCKER_ARGS["num_gpu_blocks"], sizes
    grown = after["objects_total"] - before["objects_total"]
    top = sorted(((after["objects"].get(k, 0) - before["objects"].get(k, 0), k) for k in after["objects"]),
                 reverse=True)[:8]
    assert grown < 0.1 * MEASURED, f"{grown} more live objects after {MEASURED} requests; most grown: {top}"
