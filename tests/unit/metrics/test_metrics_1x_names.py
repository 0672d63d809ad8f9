"""Our series against Dynamo 1.6.1's own scrape: every 1.6.1 series we have a counterpart for exists here
with the same name, type and label set, and the ones we do not have are listed with the reason.

The 1.6.1 scrapes in data/ were recorded from its frontend (``--router-mode kv --migration-limit 1``) and a
mocker worker (``DYN_SYSTEM_PORT``), after unary and streamed requests and a migration (a mocker killed
mid-stream): ``scripts/record_d16_metrics.py``.  Ours are built in-process the way the frontend and a
worker build them, with a request, a migration and a worker's load applied, so that every labelled series
has a sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from prometheus_client.parser import text_string_to_metric_families

from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.model_metrics import ModelLimits, ModelLimitsCollector
from dynamo.frontend.router_metrics import RouterMetrics
from dynamo.frontend.worker_metrics import QueueCollector, WorkerMetrics
from dynamo.llm.model_card import ModelCard
from dynamo.runtime.component_metrics import ComponentMetrics

DATA = Path(__file__).parent / "data"
Shape = tuple[str, frozenset[str]]  # (type, label names)

# 1.6.1 series we do not export, and why.  Each must really be absent from ours (checked below).
NOT_OURS: dict[str, str] = {
    # frontend: stages of 1.6.1's own pipeline
    "dynamo_frontend_stage_requests": "1.6.1's pipeline stages (preprocess/route/dispatch) in flight: ours are "
    "not separate stages with queues between them",
    "dynamo_frontend_stage_duration_seconds": "as stage_requests",
    # multimodal counts
    "dynamo_frontend_audio_per_request": "multimodal request counts: not counted",
    "dynamo_frontend_images_per_request": "multimodal request counts: not counted",
    "dynamo_frontend_image_tokens_per_request": "multimodal request counts: not counted",
    "dynamo_frontend_videos_per_request": "multimodal request counts: not counted",
    # tokenizer internals of 1.6.1's Rust preprocessor
    "dynamo_frontend_detokenize_token_count": "1.6.1's Rust detokenizer's own counters",
    "dynamo_frontend_detokenize_total_us": "1.6.1's Rust detokenizer's own counters",
    "dynamo_frontend_template_seconds": "1.6.1's preprocessor timings",
    "dynamo_frontend_tokenize_seconds": "1.6.1's preprocessor timings",
    "dynamo_frontend_tokenizer_latency_ms": "1.6.1's preprocessor timings",
    "dynamo_frontend_tokenizer_cache_cached_tokens": "1.6.1's tokenizer cache: we have none",
    "dynamo_frontend_tokenizer_cache_hits": "1.6.1's tokenizer cache: we have none",
    "dynamo_frontend_tokenizer_cache_misses": "1.6.1's tokenizer cache: we have none",
    "dynamo_frontend_tokenizer_cache_uncached_tokens": "1.6.1's tokenizer cache: we have none",
    "dynamo_frontend_event_loop_delay_seconds": "1.6.1's Python event-loop probe (ours: docs/performance.md)",
    "dynamo_frontend_event_loop_stall": "1.6.1's Python event-loop probe",
    # 1.6.1's queue policies (admission deadlines, token limits): ours is one FIFO with a size and a timeout
    "dynamo_frontend_router_admission_received": "1.6.1's admission policy classes: ours has none",
    "dynamo_frontend_router_admission_rejected": "1.6.1's admission policy classes (our rejections: "
    "dynamo_frontend_model_rejection_total)",
    "dynamo_frontend_router_queue_backpressure": "1.6.1's queue token limits: ours counts requests only",
    "dynamo_frontend_router_queue_pending_cached_tokens": "1.6.1's queue token limits: ours counts requests only",
    "dynamo_frontend_router_queue_pending_isl_tokens": "1.6.1's queue token limits: ours counts requests only",
    # router internals of 1.6.1's Rust KV router
    "dynamo_router_overhead_shared_cache_query_ms": "1.6.1's shared (hicache) cache tier: ours has none",
    "dynamo_router_shared_cache_errors": "1.6.1's shared cache tier",
    "dynamo_component_router_shared_cache_beyond_blocks": "1.6.1's shared cache tier",
    "dynamo_component_router_shared_cache_hit_rate": "1.6.1's shared cache tier",
    "dynamo_component_router_kv_transfer_estimated_latency_seconds": "1.6.1's disaggregated transfer estimate",
    "dynamo_component_router_overlap_blocks_lost": "1.6.1's prefill-router bookkeeping",
    "dynamo_component_router_non_max_overlap_selections": "1.6.1's prefill-router bookkeeping",
    "dynamo_component_router_requests_started": "1.6.1 counts decisions twice (started and done); our "
    "decision is one step: dynamo_component_router_requests_total",
    "dynamo_component_router_kv_best_eligible_cached_prefix_tokens": "1.6.1's cached-prefix accounting "
    "(ours: dynamo_component_router_kv_hit_rate)",
    "dynamo_component_router_kv_selected_cached_prefix_tokens": "as kv_best_eligible_cached_prefix_tokens",
    "dynamo_component_router_kv_worker_reused_tokens": "as kv_best_eligible_cached_prefix_tokens",
    "dynamo_component_router_kv_event_source_mismatch_workers": "1.6.1's event source checks",
    "dynamo_component_router_worker_registered": "workers a router knows: ours are the per-worker gauges",
    "dynamo_component_router_approximate_cache_configured_policy": "1.6.1's approximate-cache policies",
    "dynamo_component_router_approximate_cache_effective_policy": "1.6.1's approximate-cache policies",
    "dynamo_component_ckf_mutation": "1.6.1's indexer internals",
    "dynamo_component_kv_cache_event_warnings": "1.6.1's indexer internals",
    "dynamo_component_kv_cache_events_applied": "our indexer applies a worker's raw event in its C core; "
    "telling the event kinds apart would decode every event twice",
    # the worker process: 1.6.1's Rust work handler, engine and transport internals
    "dynamo_component_kv_publisher_engines_dropped_events": "1.6.1's publisher internals",
    "dynamo_engine_request": "1.6.1's Rust work handler internals",
    "dynamo_rejection_request": "1.6.1's Rust work handler internals (refused as busy: ours is the ack)",
    "dynamo_request_queue": "1.6.1's Rust work handler internals",
    "dynamo_request_plane_inflight_requests": "1.6.1's request plane internals",
    "dynamo_request_plane_queue_seconds": "1.6.1's request plane internals",
    "dynamo_request_plane_roundtrip_ttft_seconds": "1.6.1's request plane internals",
    "dynamo_request_plane_send_seconds": "1.6.1's request plane internals",
    "dynamo_transport_tcp_accept_backoff": "1.6.1's transport internals",
    "dynamo_transport_tcp_bytes_received": "1.6.1's transport internals",
    "dynamo_transport_tcp_bytes_sent": "1.6.1's transport internals",
    "dynamo_transport_tcp_errors": "1.6.1's transport internals",
    "vllm:e2e_request_latency_seconds": "1.6.1's mocker imitates vLLM's own series; ours does not",
    "vllm:gpu_cache_usage_perc": "ours: dynamo_frontend_worker_kv_cache_usage_ratio",
    "vllm:inter_token_latency_seconds": "1.6.1's mocker imitates vLLM's own series",
    "vllm:kv_cache_usage_perc": "ours: dynamo_frontend_worker_kv_cache_usage_ratio",
    "vllm:num_preemptions": "1.6.1's mocker imitates vLLM's own series",
    "vllm:num_requests_running": "ours: dynamo_frontend_worker_request_active_slots",
    "vllm:num_requests_waiting": "ours: dynamo_frontend_worker_requests_waiting",
    "vllm:time_to_first_token_seconds": "1.6.1's mocker imitates vLLM's own series",
}
NOT_OURS_PREFIXES = {
    "dynamo_tokio_": "1.6.1's Rust runtime (tokio) internals",
    "dynamo_work_handler_": "1.6.1's Rust work handler internals",
    "dynamo_component_router_active_sequence_": "1.6.1's replica-sync ingress internals",
    "dynamo_component_router_approximate_lru_": "1.6.1's approximate-cache LRU internals",
    "dynamo_component_router_kv_zmq_ingress_": "1.6.1's ZMQ event ingress internals",
}
# 1.6.1 labels the frontend process's own uptime too; ours has it on workers (the status server) only
NOT_ON_FRONTEND = {"dynamo_component_uptime_seconds"}


def shapes(families: Iterable[Any]) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    for family in families:
        if family.name.endswith("_created") or not family.samples:
            continue
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        out[family.name] = (family.type, labels)
    return out


def recorded(name: str) -> dict[str, Shape]:
    return shapes(text_string_to_metric_families((DATA / name).read_text()))


class StubRuntime:
    """What WorkerMetrics asks of a runtime: an event plane to subscribe on; no endpoints to call."""

    def event_plane(self) -> "StubRuntime":
        return self

    async def subscribe(self, scope: Any, topic: str, handler: Any) -> None:
        return None

    def namespace(self, name: str) -> Any:
        raise RuntimeError("no endpoints in this test")


class StubRouter:
    def worker_load(self, worker_id: int) -> dict[str, int]:
        return {"active_blocks": 3, "active_tokens": 40}


async def our_frontend() -> dict[str, Shape]:
    m = FrontendMetrics(prefix="dynamo_frontend")
    rm = m.request("Tiny", "chat_completions", True)
    rm.tokens(1, 12)
    rm.tokens(3, 12)
    rm.done(True)
    m.request("Tiny", "completions", False).done(False, "internal")
    m.rejected("tiny", "chat_completions")
    m.migrated("tiny", "ongoing_request")
    m.migration_done("tiny", "ongoing_request", True, 0.01)
    m.client_gone()
    wm = WorkerMetrics(StubRuntime(), m.registry, m.prefix, lambda model: StubRouter())
    await wm.add_worker("ns", "backend", 7, "tiny", "generate")
    wm.set(7, {"kv_stats": {"kv_active_blocks": 1, "kv_total_blocks": 100, "gpu_cache_usage_perc": 0.1,
                            "gpu_prefix_cache_hit_rate": 0.5},
               "worker_stats": {"num_requests_waiting": 0, "request_active_slots": 1, "request_total_slots": 8}})
    timing = wm.observer("tiny", m).request(7, 12)
    assert timing is not None
    timing.first()
    timing.done(3)
    m.registry.register(QueueCollector(lambda: {"tiny": 0}, m.prefix))
    card = ModelCard(display_name="tiny", context_length=4096, kv_cache_block_size=64)
    limits = ModelLimits.of(card, {"total_kv_blocks": 100, "max_num_seqs": 8, "max_num_batched_tokens": 2048})
    m.registry.register(ModelLimitsCollector(lambda: [("tiny", limits, True)], m.prefix))
    router = RouterMetrics(m.registry, "c164b134cffc82f2").for_router("ns", "backend", "tiny")
    router.routed("r1", 130, 1, 3)
    router.decision_overhead({"block_hashing": 1e-6, "seq_hashing": 1e-6, "indexer_find_matches": 1e-5,
                              "scheduling": 1e-4, "total": 2e-4})
    router.first_token("r1")
    router.finished("r1", 3)
    await wm.close()
    return shapes(m.registry.collect())


def our_worker() -> dict[str, Shape]:
    m = ComponentMetrics()
    ep = m.endpoint("ns", "backend", "generate", "37e6eaec45ea01ed")
    ep.received(100)
    ep.finished(ep.started(), 200)
    ep.cancelled()
    return shapes(m.registry.collect())


def not_ours(name: str) -> str | None:
    if name in NOT_OURS:
        return NOT_OURS[name]
    return next((why for prefix, why in NOT_OURS_PREFIXES.items() if name.startswith(prefix)), None)


def compare(theirs: dict[str, Shape], ours: dict[str, Shape]) -> list[str]:
    problems = []
    for name, (kind, labels) in sorted(theirs.items()):
        if not_ours(name) is not None:
            if name in ours:
                problems.append(f"{name} is listed as not ours, but we export it")
            continue
        if name not in ours:
            problems.append(f"{name} ({kind}, {sorted(labels)}) missing")
        elif ours[name] != (kind, labels):
            problems.append(f"{name}: theirs {kind} {sorted(labels)}, ours {ours[name][0]} {sorted(ours[name][1])}")
    return problems


async def test_frontend_series_are_1x_named_typed_and_labelled() -> None:
    theirs = {n: s for n, s in recorded("dynamo161_frontend.prom").items() if n not in NOT_ON_FRONTEND}
    assert compare(theirs, await our_frontend()) == []


def test_worker_series_are_1x_named_typed_and_labelled() -> None:
    assert compare(recorded("dynamo161_worker.prom"), our_worker()) == []


def test_the_not_ours_list_names_only_1x_series() -> None:
    """The list stays honest: each entry is a series 1.6.1 has (in one of the two scrapes)."""
    both = {**recorded("dynamo161_frontend.prom"), **recorded("dynamo161_worker.prom")}
    assert sorted(n for n in NOT_OURS if n not in both) == []
    assert all(any(n.startswith(p) for n in both) for p in NOT_OURS_PREFIXES)


async def test_the_renamed_series_keep_no_old_name() -> None:
    """Where ours differed, 1.x's name won and the old one is gone (inflight_requests stays: 1.6.1 keeps it,
    deprecated, beside active_requests)."""
    ours = await our_frontend()
    assert "dynamo_frontend_worker_kv_active_blocks" not in ours
    assert {"dynamo_frontend_active_requests", "dynamo_frontend_inflight_requests"} <= set(ours)
