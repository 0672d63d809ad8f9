"""SGLang and TensorRT-LLM workers publish KV events for the router (engine_kv_events.py).

Neither engine runs here (both need CUDA), so the engines are stand-ins in ``sys.modules`` that behave as
their documentation says: SGLang's ``Engine(**server_args)`` reads ``kv_events_config`` (a JSON string)
and publishes msgpack ``EventBatch`` es of tagged arrays over ZMQ; TensorRT-LLM's ``LLM`` queues event
dicts that ``get_kv_cache_events(timeout)`` hands over.  The events are written from those documented
shapes, and checked against a real indexer: the router finds for a prompt it hashes itself exactly the
blocks the engine said it stored.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from dynamo.kv import engine_sources as engine_kv_events
from dynamo.kv.engine_sources import sglang_kv_events_wanted, trtllm_kv_events_wanted
from dynamo.kv.indexer import KvIndexer
from dynamo.llm.model_card import ModelCard

BS = 4
PROMPT = list(range(100, 112))  # three blocks of 4
WORKER = 0x5EED


def _cfg(**kw: Any) -> SimpleNamespace:
    base = dict(input="dyn://ns.backend.generate", tensor_parallel_size=1, num_nodes=1, node_rank=0,
                leader_addr=None, base_gpu_id=0, context_length=None, kv_cache_block_size=None)
    return SimpleNamespace(**{**base, **kw})


def _card(tmp_path: Path) -> ModelCard:
    card = ModelCard(display_name="m")
    card.path = tmp_path  # type: ignore[assignment]
    card.kv_cache_block_size = BS
    return card


class Router:
    """The frontend's side: our events applied to a real indexer."""

    def __init__(self) -> None:
        self.indexer = KvIndexer()
        self.events: list[dict] = []
        self.got = asyncio.Event()

    def publish(self, event: dict) -> None:
        self.events.append(event)
        assert self.indexer.apply_event(event)
        self.got.set()

    def cached(self, tokens: list[int]) -> int:
        from dynamo.kv.hashing import compute_block_hashes

        return self.indexer.find_matches(compute_block_hashes(tokens, BS)).get(WORKER, 0)


# -- SGLang --------------------------------------------------------------------------------------------

class FakeSubscriber:
    """Our ZMQ subscriber without pyzmq (not in the core install): bind() gives an address, and the
    test hands payloads to the sink as the socket would."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.endpoint: str | None = None
        self.started = False

    def bind(self) -> str:
        self.endpoint = "tcp://127.0.0.1:45557"
        return self.endpoint

    def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False


def _sglang_module(seen: dict[str, Any]) -> types.ModuleType:
    mod = types.ModuleType("sglang")

    class Engine:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)
            # SGLang validates kv_events_config with its KVEventsConfig (pydantic, from JSON)
            config = json.loads(kwargs["kv_events_config"])
            assert set(config) <= {"publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                                   "max_queue_size", "topic"}
            seen["config"] = config

        def shutdown(self) -> None:
            seen["shutdown"] = True

    mod.Engine = Engine  # type: ignore[attr-defined]
    return mod


def _sglang_batch(*events: list[Any]) -> bytes:
    """SGLang's EventBatch: [ts, events] with tagged-array events (BlockStored: block_hashes,
    parent_block_hash, token_ids, block_size, lora_id)."""
    return msgspec.msgpack.encode([1700000000.25, list(events)])


async def test_sglang_worker_points_sglang_at_our_socket_and_publishes_its_blocks(tmp_path, monkeypatch):
    from dynamo.engines.sglang import SglangEngine

    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "sglang", _sglang_module(seen))
    monkeypatch.setattr(engine_kv_events, "ZmqKvEventSubscriber", FakeSubscriber)
    card = _card(tmp_path)
    engine = SglangEngine(_cfg(), card)
    router = Router()
    await engine.start()
    engine.attach(WORKER, publish_kv_event=router.publish)
    try:
        assert seen["config"] == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:45557", "topic": ""}
        # no '*' in the endpoint: SGLang's publisher connects to it, and we are bound there
        assert seen["page_size"] == BS  # its pages are the router's blocks
        assert engine.publishes_kv_events
        sink = engine._kv.sink
        # SGLang's own hashes are opaque ints; ours are recomputed from the tokens
        sink.handle_payload(_sglang_batch(["BlockStored", [9001, 9002], None, PROMPT[:8], BS, None]))
        sink.handle_payload(_sglang_batch(["BlockStored", [9003], 9002, PROMPT[8:12], BS, None]))
        assert router.cached(PROMPT) == 3
        assert router.cached(PROMPT[:4] + [1, 2, 3, 4]) == 1
        sink.handle_payload(_sglang_batch(["BlockRemoved", [9003]]))
        assert router.cached(PROMPT) == 2
        assert len(engine.kv_state_dump()["blocks"]) == 2  # what a late frontend reads (kv_state)
        ids = [e["event"]["event_id"] for e in router.events]
        assert ids == list(range(ids[0], ids[0] + 3))  # numbered in order, as a router's resync expects
        sink.handle_payload(_sglang_batch(["AllBlocksCleared"]))
        assert router.cached(PROMPT) == 0
        assert engine.all_load_metrics() == []
    finally:
        await engine.close()
    assert seen.get("shutdown") and not engine.publishes_kv_events


async def test_sglang_page_size_given_is_kept_and_becomes_the_block_size(tmp_path, monkeypatch):
    from dynamo.engines.sglang import SglangEngine

    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "sglang", _sglang_module(seen))
    monkeypatch.setattr(engine_kv_events, "ZmqKvEventSubscriber", FakeSubscriber)
    card = _card(tmp_path)
    engine = SglangEngine(_cfg(kv_cache_block_size=32), card)
    await engine.start()
    try:
        assert seen["page_size"] == 32 and card.kv_cache_block_size == 32
        assert engine._kv.sink.translator.block_size == 32
    finally:
        await engine.close()


def test_sglang_kv_events_only_where_a_router_can_follow_them():
    dyn = _cfg()
    assert sglang_kv_events_wanted(dyn, {}, {}) is None
    assert "dyn://" in sglang_kv_events_wanted(_cfg(input="http"), {}, {})
    assert "prefix cache" in sglang_kv_events_wanted(dyn, {"disable_radix_cache": True}, {})
    assert "kv_events_config" in sglang_kv_events_wanted(dyn, {}, {"kv_events_config": "{}"})
    assert "dp_size" in sglang_kv_events_wanted(dyn, {"dp_size": 2}, {})
    assert "follower" in sglang_kv_events_wanted(dyn, {"node_rank": 1}, {})


async def test_sglang_worker_that_cannot_follow_says_so(tmp_path, monkeypatch, caplog):
    from dynamo.engines.sglang import SglangEngine

    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "sglang", _sglang_module(seen))
    caplog.set_level("INFO")
    engine = SglangEngine(_cfg(), _card(tmp_path), {"dp_size": 2})
    assert not engine.publishes_kv_events
    assert "no KV events for the router: dp_size > 1" in caplog.text


# -- TensorRT-LLM ----------------------------------------------------------------------------------------

def _trtllm_module(seen: dict[str, Any], batches: list[list[dict]]) -> types.ModuleType:
    mod = types.ModuleType("tensorrt_llm")

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)
            kv = kwargs.get("kv_cache_config") or {}
            self.args = SimpleNamespace(max_seq_len=None, kv_cache_config=SimpleNamespace(
                tokens_per_block=kv.get("tokens_per_block", 32)))
            self.polled = asyncio.Event()

        def get_kv_cache_events(self, timeout: float = 2) -> list[dict]:
            if batches:
                return batches.pop(0)
            import time

            time.sleep(min(timeout, 0.05))
            return []

        def shutdown(self) -> None:
            seen["shutdown"] = True

    mod.LLM = LLM  # type: ignore[attr-defined]
    mod.SamplingParams = dict  # type: ignore[attr-defined]
    return mod


def _trt_block(h: int, tokens: list[int], level: int = 0, extra: int = 0) -> dict:
    return {"type": "stored_block", "block_hash": h, "lora_id": None, "cache_level": level, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in tokens]}


async def test_trtllm_worker_turns_events_on_and_publishes_its_blocks(tmp_path, monkeypatch):
    from dynamo.engines.trtllm import TrtllmEngine

    seen: dict[str, Any] = {}
    batches = [
        [{"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}, "window_size": 12},
         {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
             _trt_block(-7, PROMPT[:4]), _trt_block(-8, PROMPT[4:8])]}, "window_size": 12}],
        [{"event_id": 2, "data": {"type": "stored", "parent_hash": -8, "blocks": [_trt_block(-9, PROMPT[8:12])]},
          "window_size": 12},
         {"event_id": 3, "data": {"type": "updated", "block_hash": -9, "priority": {"old_value": 35,
                                                                                   "new_value": 50}}}],
        [{"event_id": 4, "data": {"type": "removed", "block_hashes": [-9]}, "window_size": 12}],
    ]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", _trtllm_module(seen, batches))
    monkeypatch.setattr(engine_kv_events, "TRTLLM_POLL_TIMEOUT_S", 0.05)
    card = _card(tmp_path)
    engine = TrtllmEngine(_cfg(kv_cache_block_size=BS), card)
    router = Router()
    engine.attach(WORKER, publish_kv_event=router.publish)
    await engine.start()
    try:
        assert seen["kv_cache_config"] == {"tokens_per_block": BS, "event_buffer_max_size": 1024,
                                           "enable_block_reuse": True}
        assert engine.publishes_kv_events
        while len(router.events) < 3:  # stored, stored, removed
            router.got.clear()
            await asyncio.wait_for(router.got.wait(), 10)
        kinds = [next(iter(e["event"]["data"])) if isinstance(e["event"]["data"], dict) else e["event"]["data"]
                 for e in router.events]
        assert kinds == ["stored", "stored", "removed"]
        assert router.cached(PROMPT) == 2  # three stored, the last removed
        assert len(engine.kv_state_dump()["blocks"]) == 2
    finally:
        await engine.close()
    assert seen.get("shutdown") and not engine.publishes_kv_events


def test_trtllm_blocks_the_router_cannot_match_are_left_out():
    from dynamo.kv.engine_sources import TrtllmKvEvents

    kv = TrtllmKvEvents(BS)
    router = Router()
    kv.attach(WORKER, router.publish)
    # multimodal content (token_extra_id) and the secondary (offload) pool are not routed on
    assert kv.handle([{"event_id": 1, "data": {"type": "stored", "parent_hash": None,
                                               "blocks": [_trt_block(1, PROMPT[:4], extra=7)]}}]) == 0
    assert kv.handle([{"event_id": 2, "data": {"type": "stored", "parent_hash": None,
                                               "blocks": [_trt_block(2, PROMPT[:4], level=1)]}}]) == 0
    assert kv.handle([{"event_id": 3, "data": {"type": "stored", "parent_hash": None,
                                               "blocks": [_trt_block(3, PROMPT[:4])]}}]) == 1
    assert router.cached(PROMPT) == 1


def test_trtllm_kv_events_only_where_a_router_can_follow_them():
    dyn = _cfg()
    assert trtllm_kv_events_wanted(dyn, {}) is None
    assert trtllm_kv_events_wanted(dyn, {"kv_cache_config": {"event_buffer_max_size": 64}}) is None
    assert "dyn://" in trtllm_kv_events_wanted(_cfg(input="http"), {})
    assert "block reuse" in trtllm_kv_events_wanted(dyn, {"kv_cache_config": {"enable_block_reuse": False}})
    assert "is 0" in trtllm_kv_events_wanted(dyn, {"kv_cache_config": {"event_buffer_max_size": 0}})


async def test_sglang_events_over_a_real_zmq_socket(tmp_path, monkeypatch):
    """Where pyzmq is installed (the vLLM tier's virtualenv): SGLang's publisher side done as its
    documentation says (a PUB socket that connects to an endpoint without '*', frames topic / 8-byte
    big-endian sequence / msgpack batch) reaches the router through our subscriber."""
    zmq = pytest.importorskip("zmq")
    from dynamo.engines.sglang import SglangEngine

    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "sglang", _sglang_module(seen))
    engine = SglangEngine(_cfg(), _card(tmp_path))
    router = Router()
    await engine.start()
    engine.attach(WORKER, publish_kv_event=router.publish)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.connect(seen["config"]["endpoint"])
        payload = _sglang_batch(["BlockStored", [1, 2, 3], None, PROMPT, BS, None])
        for seq in range(200):  # a PUB socket drops what it sends before the subscription is through
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            try:
                await asyncio.wait_for(router.got.wait(), 0.05)
                break
            except TimeoutError:
                continue
        assert router.cached(PROMPT) == 3
    finally:
        pub.close(linger=0)
        ctx.term()
        await engine.close()
