"""vLLM-style KV events (BlockStored / BlockRemoved / AllBlocksCleared, msgpack over ZMQ) translated into
the router's events, checked against a real :class:`KvIndexer`: what the engine caches is what the router
finds for a prompt it hashes itself.  The batches are built here in vLLM's wire shapes (tagged maps, as
vLLM >= 0.11 sends them; tagged arrays, as older vLLM and SGLang do); the vLLM tier checks the ZMQ socket
(pyzmq comes with vLLM) and the real engine (tests/vllm/test_vllm_kv_events.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from dynamo.engines.vllm.engine import kv_events_wanted
from dynamo.kv.hashing import compute_block_hashes, compute_hashes
from dynamo.kv.indexer import KvIndexer
from dynamo.kv.zmq_events import (
    BatchError,
    KvEventSink,
    KvEventTranslator,
    SchedulerStatsMetrics,
    decode_event_batch,
    trtllm_events_to_common,
)

BS = 4
WORKER = 77


def vh(*tokens: int) -> bytes:
    """An engine-side block hash: opaque bytes, as vLLM's SHA-256 hashes are."""
    return hashlib.sha256(repr(tokens).encode()).digest()


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], block_size: int = BS, **kw: Any) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **kw}


def removed(hashes: list[bytes], **kw: Any) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def batch(*events: dict, dp_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([1700000000.5, list(events), dp_rank])


class Harness:
    """An engine's events -> translator -> sink -> a real indexer, as the frontend would apply them."""

    def __init__(self, block_size: int = BS):
        self.indexer = KvIndexer()
        self.sent: list[dict] = []
        self.sink = KvEventSink(KvEventTranslator(block_size), WORKER, self._publish)

    def _publish(self, event: dict) -> None:
        self.sent.append(event)
        assert self.indexer.apply_event(event)

    def feed(self, *events: dict) -> int:
        return self.sink.handle_payload(batch(*events))

    def cached(self, prompt: list[int]) -> int:
        return self.indexer.find_matches(compute_block_hashes(prompt, BS)).get(WORKER, 0)


PROMPT = list(range(100, 116))  # 4 blocks of 4
B = [tuple(PROMPT[i:i + BS]) for i in range(0, 16, BS)]


def test_stored_chain_is_rehashed_so_the_router_finds_the_prompt():
    h = Harness()
    assert h.feed(stored([vh(*B[0]), vh(*B[1])], None, PROMPT[:8])) == 1
    local, seq = compute_hashes(PROMPT[:8], BS)
    data = h.sent[0]["event"]["data"]["stored"]
    assert data == {"parent_hash": None, "blocks": [{"block_hash": s, "tokens_hash": lo} for lo, s in zip(local, seq, strict=True)]}
    assert h.sent[0]["worker_id"] == WORKER
    assert h.cached(PROMPT) == 2
    # a later store under the engine's parent hash chains on: the router's sequence hashes match
    h.feed(stored([vh(*B[2]), vh(*B[3])], vh(*B[1]), PROMPT[8:]))
    assert h.sent[1]["event"]["data"]["stored"]["parent_hash"] == seq[1]
    assert [b["block_hash"] for b in h.sent[1]["event"]["data"]["stored"]["blocks"]] == compute_hashes(PROMPT, BS)[1][2:]
    assert h.cached(PROMPT) == 4
    assert h.sent[1]["event"]["event_id"] == h.sent[0]["event"]["event_id"] + 1


def test_removed_and_cleared():
    h = Harness()
    h.feed(stored([vh(*b) for b in B], None, PROMPT))
    h.feed(removed([vh(*B[2])]))
    assert h.cached(PROMPT) == 2  # contiguous prefix only
    h.feed({"type": "AllBlocksCleared"})
    assert h.sent[-1]["event"]["data"] == "cleared"
    assert h.cached(PROMPT) == 0 and len(h.sink.translator) == 0
    # removals of hashes it never announced are quiet no-ops
    assert h.feed(removed([vh(1, 2, 3, 4)])) == 0


def test_two_copies_of_a_block_are_removed_when_the_last_goes():
    h = Harness()
    h.feed(stored([vh(*B[0])], None, PROMPT[:4]))
    h.feed(stored([vh(*B[0])], None, PROMPT[:4]))  # a second request computed the same block at once
    assert h.feed(removed([vh(*B[0])])) == 0
    assert h.cached(PROMPT) == 1
    assert h.feed(removed([vh(*B[0])])) == 1
    assert h.cached(PROMPT) == 0


def test_what_the_router_cannot_use_is_skipped(caplog: pytest.LogCaptureFixture):
    h = Harness()
    with caplog.at_level(logging.WARNING):
        # another block size: hashed over other boundaries, so nothing is announced (warned once)
        assert h.feed(stored([vh(*PROMPT[:8])], None, PROMPT[:8], block_size=8)) == 0
        assert h.feed(stored([vh(*PROMPT[:8])], None, PROMPT[:8], block_size=8)) == 0
        # a parent it never saw: the chained hash is unknown
        assert h.feed(stored([vh(*B[1])], vh(9, 9, 9, 9), PROMPT[4:8])) == 0
        # partial blocks
        assert h.feed(stored([vh(*B[0])], None, PROMPT[:3])) == 0
    assert sum("block size" in r.message or "blocks of 8" in r.message for r in caplog.records) == 1
    assert any("never reported" in r.message for r in caplog.records)
    # multimodal / salted blocks, and an adapter known by number only, are not announced, nor their children
    assert h.feed(stored([vh(*B[0])], None, PROMPT[:4], lora_id=3)) == 0
    assert h.feed(stored([vh(*B[0])], None, PROMPT[:4], extra_keys=[["salt"]])) == 0
    assert h.feed(stored([vh(*B[0])], None, PROMPT[:4], lora_name="a", extra_keys=[["a", "salt"]])) == 0
    assert h.feed(stored([vh(*B[1])], vh(*B[0]), PROMPT[4:8])) == 0
    # offload tiers and other KV cache groups are not the worker's GPU cache
    assert h.feed(stored([vh(*B[0])], None, PROMPT[:4], medium="CPU")) == 0
    assert h.feed(stored([vh(*B[0])], None, PROMPT[:4], group_idx=1)) == 0
    assert h.cached(PROMPT) == 0 and h.sent == []
    assert h.sink.translator.skipped == 8  # offload and other-group events are not counted: not ours to route


def test_tagged_array_form_of_older_vllm_and_sglang():
    h = Harness()
    events = [["BlockStored", [11, 12], None, PROMPT[:8], BS, None, None], ["BlockRemoved", [12], None],
              ["AllBlocksCleared"]]
    payload = msgspec.msgpack.encode([0.0, events])
    decoded, dp = decode_event_batch(payload)
    assert dp is None and [e["type"] for e in decoded] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert h.sink.handle_events(decoded[:2]) == 2
    assert h.cached(PROMPT) == 1


def test_bad_batches_are_skipped(caplog: pytest.LogCaptureFixture):
    with pytest.raises(BatchError):
        decode_event_batch(b"\xc1garbage")
    with pytest.raises(BatchError):
        decode_event_batch(msgspec.msgpack.encode({"not": "a batch"}))
    h = Harness()
    with caplog.at_level(logging.WARNING):
        assert h.sink.handle_payload(msgspec.msgpack.encode([0.0, [42]])) == 0
    assert "skipped" in caplog.text


def test_trtllm_events_map_onto_the_same_translation():
    events = [
        {"event_id": 1, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}},
        {"event_id": 2, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": 501, "lora_id": None, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in B[0]]},
            {"type": "stored_block", "block_hash": 502, "lora_id": None, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in B[1]]}]}},
        {"event_id": 3, "data": {"type": "removed", "block_hashes": [502]}},
    ]
    h = Harness()
    common = trtllm_events_to_common(events)
    assert [e["type"] for e in common] == ["BlockStored", "BlockRemoved"]
    h.sink.handle_events(common[:1])
    assert h.cached(PROMPT) == 2
    h.sink.handle_events(common[1:])
    assert h.cached(PROMPT) == 1


def test_kv_events_only_for_dyn_workers_with_prefix_caching():
    dyn = SimpleNamespace(input="dyn://ns.vllm.generate")
    assert kv_events_wanted(dyn, {})
    assert not kv_events_wanted(SimpleNamespace(input="http"), {})
    assert not kv_events_wanted(dyn, {"enable_prefix_caching": False})
    assert not kv_events_wanted(dyn, {"kv_events_config": {"enable_kv_cache_events": True}})


async def test_scheduler_stats_become_load_metrics():
    got: asyncio.Queue[dict] = asyncio.Queue()
    m = SchedulerStatsMetrics(total_blocks=200, max_num_seqs=8, worker_id=5, publish=got.put_nowait,
                              loop=asyncio.get_running_loop())
    stats = SimpleNamespace(num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=0,
                            kv_cache_usage=0.25, prefix_cache_stats=SimpleNamespace(reset=False, queries=64, hits=48))
    m.factory(None, 0).record(stats, None)
    msg = await asyncio.wait_for(got.get(), 5)
    assert msg == {"worker_id": 5, "data": {
        "worker_stats": {"data_parallel_rank": 0, "request_active_slots": 2, "request_total_slots": 8,
                         "num_requests_waiting": 1},
        "kv_stats": {"kv_active_blocks": 50, "kv_total_blocks": 200, "gpu_cache_usage_perc": 0.25,
                     "gpu_prefix_cache_hit_rate": 0.75},
        "spec_decode_stats": None}}
    m.record(stats, None)  # nothing changed: nothing sent
    stats.num_running_reqs = 0
    m.record(stats, None)  # a change right after: sent when the 10 ms window ends
    later = await asyncio.wait_for(got.get(), 5)
    assert later["data"]["worker_stats"]["request_active_slots"] == 0
    assert got.empty()
    m.close()


async def test_a_hit_rate_that_moves_alone_is_published():
    """A short request can start and finish between two of vLLM's stat records: the load is the same
    before and after, and only the prefix-cache hit rate says it reused a prefix."""
    got: asyncio.Queue[dict] = asyncio.Queue()
    m = SchedulerStatsMetrics(total_blocks=200, max_num_seqs=8, worker_id=5, publish=got.put_nowait,
                              loop=asyncio.get_running_loop())
    stats = SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, num_skipped_waiting_reqs=0,
                            kv_cache_usage=0.0, prefix_cache_stats=SimpleNamespace(reset=False, queries=600, hits=0))
    m.record(stats, None)
    first = await asyncio.wait_for(got.get(), 5)
    assert first["data"]["kv_stats"]["gpu_prefix_cache_hit_rate"] == 0.0
    stats.prefix_cache_stats = SimpleNamespace(reset=False, queries=600, hits=576)
    m.record(stats, None)
    later = await asyncio.wait_for(got.get(), 5)
    assert later["data"]["kv_stats"]["gpu_prefix_cache_hit_rate"] == 0.48
    assert later["data"]["worker_stats"]["request_active_slots"] == 0
    m.close()


def test_an_adapters_blocks_are_announced_under_its_salt():
    """vLLM names the adapter of a store (``lora_name``, also first in each block's ``extra_keys``): the
    blocks are hashed with that adapter's seed, so the router matches them for that adapter's prompts
    only, never for the base model's or another adapter's."""
    h = Harness()
    blocks = [vh(*B[0]), vh(*B[1])]
    assert h.feed(stored(blocks, None, PROMPT[:8], lora_name="sql", lora_id=1, extra_keys=[["sql"], ["sql"]])) == 1
    local, seq = compute_hashes(PROMPT[:8], BS, lora_name="sql")
    assert h.sent[0]["event"]["data"]["stored"]["blocks"] == [
        {"block_hash": s, "tokens_hash": lo} for lo, s in zip(local, seq, strict=True)]
    found = h.indexer.find_matches
    assert found(compute_block_hashes(PROMPT, BS, "sql")).get(WORKER) == 2
    assert found(compute_block_hashes(PROMPT, BS, "other")).get(WORKER, 0) == 0
    assert h.cached(PROMPT) == 0  # the base model's prompt
    # a child store under the adapter's block chains on; removal by the engine's hash works as for the base
    assert h.feed(stored([vh(*B[2])], blocks[1], PROMPT[8:12], lora_name="sql", extra_keys=[["sql"]])) == 1
    assert found(compute_block_hashes(PROMPT, BS, "sql")).get(WORKER) == 3
    assert h.feed(removed([blocks[1]])) == 1
    assert found(compute_block_hashes(PROMPT, BS, "sql")).get(WORKER) == 1
    # the tagged-array form carries lora_name after medium
    h2 = Harness()
    assert h2.feed(["BlockStored", [21], None, PROMPT[:4], BS, 1, None, "sql", [["sql"]]]) == 1  # type: ignore[arg-type]
    assert h2.indexer.find_matches(compute_block_hashes(PROMPT, BS, "sql")).get(WORKER) == 1
