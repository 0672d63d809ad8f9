"""llama.cpp's prefix cache as the KV router sees it, with the real SmolLM2 GGUF.

In process: a follow-up request finds the previous request's slot free and reuses its prefix; a
request whose prefix sits in a *busy* slot gets a copy of that slot's cache and the same greedy answer
as without it; the engine's KV events, fed to a router, describe exactly what the slots hold, and so
does its dump (what its recovery endpoint answers).  Distributed: two ``out=llamacpp`` workers behind a ``--router-mode kv``
frontend (real etcd and NATS): the second request with the same long prefix goes to the worker that
holds it, and that worker's llama.cpp reuses the prefix.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import pytest

from dynamo.engines.llamacpp.engine import ROUTER_OVERLAP_WEIGHT
from dynamo.kv import KvRouter
from dynamo.kv.hashing import compute_hashes
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions
from harness.events import kv_events, nats_subject, payload
from harness.fleet import kv_frontend, read_kv_states, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import etcd_and_nats_env
from harness.wait import until
from tests.integration.test_kv_routing import frontend_caught_up, text

pytestmark = pytest.mark.timeout(180)
BS = 16


def chat(tok: Any, system: str, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                      "<|im_start|>assistant\n")


SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 12


async def ask(engine: Any, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int | None]:
    req = PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=max_tokens),
                              sampling_options=SamplingOptions(temperature=0), eos_token_ids=[2])
    tokens, cached = [], None
    async for out in engine.generate(req, Context()):
        if cached is None:
            cached = out.cached_tokens
        tokens += out.token_ids
    return tokens, cached


async def _engine(gguf: Path, slots: int = 3) -> Any:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(gguf, context_length=512, args={"n_parallel": slots, "n_threads": 1}, block_size=BS)
    await engine.start()
    return engine


async def test_a_follow_up_reuses_the_previous_turns_slot_and_events_match_the_slots(gguf, tok):
    engine = await _engine(gguf)
    events: list[dict[str, Any]] = []
    router = KvRouter(block_size=BS)

    def publish(event: dict[str, Any]) -> None:
        events.append(event)
        router.apply_event(event)

    try:
        engine.attach(77, publish_kv_event=publish, publish_metrics=lambda m: None)
        assert events[0]["event"]["data"] == "cleared"
        first = chat(tok, SYSTEM, "What is 2+2?")
        _, cached = await ask(engine, first)
        assert cached == 0
        # the same system prompt right after: the first turn's slot is free and holds it
        second = chat(tok, SYSTEM, "Name three colors.")
        _, cached = await ask(engine, second)
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        assert cached == shared > 100
        # the router, fed only the engine's events (they reach the loop after each step), finds the
        # cached blocks of the prompt
        whole = {77: len(compute_hashes(second, BS)[0])}
        await until(lambda: router.find_matches(second) == whole, 5, "the second turn's KV events")
        assert router.find_matches(chat(tok, SYSTEM, "Another question?")) == {77: shared // BS}
        # each slot's blocks are the router's hashes of its tokens; the dump is their union
        union = set()
        for slot in engine.caches.slots:
            assert engine.caches.slot_blocks.blocks(slot.seq_id) == compute_hashes(slot.cached, BS)[1]
            union |= set(engine.caches.slot_blocks.blocks(slot.seq_id))
        assert {b[0] for b in engine.kv_state_dump()["blocks"]} == union
        metrics = engine.load_metrics()
        assert metrics["kv_stats"]["kv_active_blocks"] == len(union)
        assert metrics["kv_stats"]["kv_total_blocks"] == 3 * 512 // BS
        assert metrics["worker_stats"]["request_active_slots"] == 0
        assert 0 < metrics["kv_stats"]["gpu_prefix_cache_hit_rate"] < 1
    finally:
        await engine.close()


async def test_a_turn_ended_by_its_consumer_frees_its_slot_for_the_next_turn(gguf, tok):
    engine = await _engine(gguf)
    try:
        first = chat(tok, SYSTEM, "What is 2+2?")
        req = PreprocessedRequest(token_ids=first, stop_conditions=StopConditions(max_tokens=200),
                                  sampling_options=SamplingOptions(temperature=0), eos_token_ids=[])
        stream = engine.generate(req, Context())
        async for _ in stream:  # the post-processor saw a stop string, or the client went away
            break
        await stream.aclose()
        # the next turn comes at once: the slot that holds the system prompt must count as free
        _, cached = await ask(engine, chat(tok, SYSTEM, "Name three colors."))
        assert cached == next(i for i, (a, b) in enumerate(zip(first, chat(tok, SYSTEM, "Name three colors."), strict=False))
                              if a != b)
        assert engine.caches.copies == 0
    finally:
        await engine.close()


async def test_a_prefix_being_computed_is_waited_for_not_computed_twice(gguf, tok):
    engine = await _engine(gguf)
    try:
        # two users of one system prompt at once: the second waits for the first's prefill, then copies it
        (_, first), (_, second) = await asyncio.gather(ask(engine, chat(tok, SYSTEM, "What is 2+2?")),
                                                       ask(engine, chat(tok, SYSTEM, "Name three colors.")))
        assert first == 0
        assert second > 100 and engine.caches.copies == 1
    finally:
        await engine.close()


@pytest.mark.parametrize("through", ["sequence state", "whole stream"])
async def test_a_prefix_held_by_a_busy_slot_is_copied_with_the_same_answer(gguf, tok, through):
    """Both ways of copying: a donor holding little of its stream goes through its sequence state (only
    its cells: llama_memory_seq_cp copies all n_ctx_seq of them, which cost a short prompt more than its
    prefill), a fuller one through seq_cp."""
    question = chat(tok, SYSTEM, "What is 2+2?")
    # the reference: the same prefix reused from the slot that computed it (a prefill split at another
    # point can flip a near-tie in greedy decoding, so compare like with like)
    plain = await _engine(gguf)
    try:
        await ask(plain, chat(tok, SYSTEM, "Name three colors."), max_tokens=1)
        expected, cached = await ask(plain, question)
        assert cached > 100 and plain.caches.copies == 0
    finally:
        await plain.close()
    engine = await _engine(gguf)
    engine.caches.state_copy_max_tokens = 512 if through == "sequence state" else 0
    try:
        busy = asyncio.create_task(ask(engine, chat(tok, SYSTEM, "Name three colors."), max_tokens=64))
        # the long request is decoding: its slot holds the system prompt
        await until(lambda: any(s.req is not None and not s.pending and s.generated for s in engine.caches.slots), 60,
                    "the long request to decode")
        tokens, cached = await ask(engine, question)
        assert engine.caches.copies == 1
        assert engine.caches.state_copies == (1 if through == "sequence state" else 0)
        assert cached > 100
        assert tokens == expected
        await busy
    finally:
        await engine.close()


async def test_a_new_conversation_does_not_overwrite_another_conversations_cache(gguf, tok):
    """Slots that share only a short system prompt with a new request keep their conversations: the new
    request takes an empty slot, so revisiting the first conversation reuses all of it (as
    llama-server's slot choice does; before, every new prompt landed in the one slot that held the
    system prompt and the benchmark's 8 streams found 7 of their 8 prompts gone)."""
    engine = await _engine(gguf)
    try:
        story = chat(tok, "Be brief.", "Tell me about the history of the city of Rome, its emperors and its roads. " * 4)
        _, cached = await ask(engine, story)
        assert cached == 0
        other = chat(tok, "Be brief.", "Name three colors.")
        shared = next(i for i, (a, b) in enumerate(zip(story, other, strict=False)) if a != b)
        assert 2 * shared < len(story)  # the premise: the new prompt shares only a short prefix
        await ask(engine, other)
        _, cached = await ask(engine, story)  # back to the first conversation
        assert cached == len(story) - 1  # all of it (the last prompt token is always computed)
    finally:
        await engine.close()


async def test_a_new_conversation_of_a_group_keeps_the_groups_live_conversation(gguf, tok):
    """All slots hold something; one holds a conversation of the group (its system prompt, then a turn),
    the other an older, unrelated one.  A new conversation of the group reuses the system prompt through
    a copy into the older slot, and the group's conversation keeps its history for its next turn (before,
    the new one took that slot, because it reused more than half of it, and the next turn recomputed)."""
    engine = await _engine(gguf, slots=2)
    try:
        await ask(engine, chat(tok, "Be brief.", "Name three colors."))  # the older, unrelated one
        live = chat(tok, SYSTEM, "Tell me about the history of the city of Rome and its roads. " * 5)
        await ask(engine, live)
        newcomer = chat(tok, SYSTEM, "What is 2+2?")
        shared = next(i for i, (a, b) in enumerate(zip(live, newcomer, strict=False)) if a != b)
        assert 2 * shared >= len(live)  # the premise: the newcomer reuses more than half of that slot
        _, cached = await ask(engine, newcomer)
        assert cached >= shared - 1 and engine.caches.copies == 1  # the system prompt, copied
        _, cached = await ask(engine, live)  # the live conversation comes back
        assert cached == len(live) - 1  # all of it (the last prompt token is always computed)
    finally:
        await engine.close()


# -- distributed ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env() as env:
        yield env


@pytest.fixture(scope="module")
def llama_workers(servers, gguf: Path, tmp_path_factory) -> Iterator[list[DynamoWorker]]:
    args = write_engine_args(tmp_path_factory.mktemp("llamacpp") / "args.json", {"n_parallel": 2, "n_threads": 1})
    env = {**servers, "DYN_LOG": "info,dynamo.engines.llamacpp=debug"}
    with workers_running([DynamoWorker("in=dyn://kvllama.llamacpp.generate", "out=llamacpp", str(gguf),
                                       "--model-name", "kvllama", "--context-length", "512",
                                       "--extra-engine-args", str(args), env=env, startup_timeout=120)
                          for _ in range(2)]) as ws:
        yield ws


async def _request(servers: dict[str, str], fe: DynamoRun, prompt: str, want_blocks: int = 0
                   ) -> tuple[dict[str, Any], int]:
    """Send one completion; (the router's decision, blocks the worker announced as stored meanwhile)."""
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: list[dict[str, Any]] = []
    stored: dict[int, int] = {}
    enough = asyncio.Event()

    async def on_decision(msg: Any) -> None:
        decisions.append(payload(msg.data))

    async def on_event(msg: Any) -> None:
        for e in kv_events(msg.data):
            on_kv(e)

    def on_kv(e: dict[str, Any]) -> None:
        data = e["event"]["data"]
        if isinstance(data, dict) and "stored" in data:
            stored[e["worker_id"]] = stored.get(e["worker_id"], 0) + len(data["stored"]["blocks"])
            if max(stored.values()) >= want_blocks:
                enough.set()

    try:
        await nc.subscribe(nats_subject("kvllama", "kv-hit-rate"), cb=on_decision)
        await nc.subscribe(nats_subject("kvllama", "kv-events", "llamacpp", "generate"), cb=on_event)
        await nc.flush()
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(fe.api_url + "/completions", json={
                "model": "kvllama", "prompt": prompt, "max_tokens": 2, "nvext": {"ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        if want_blocks:
            await asyncio.wait_for(enough.wait(), 10)  # the prefix's blocks are announced
            # ... and the frontend's router has them (it got them before the marker)
            await frontend_caught_up(nc, fe, nats_subject("kvllama", "kv-events", "llamacpp", "generate"))
        await until(lambda: decisions, 10, "the router's decision")
    finally:
        await nc.close()
    (decision,) = decisions
    return decision, max(stored.values(), default=0)


def test_the_router_sends_a_shared_prefix_to_the_llamacpp_worker_that_caches_it(servers, llama_workers):
    fe = kv_frontend(servers, ready=lambda fe: re.search(r"KV router for kvllama: .*KV events", fe.stderr_text())
                     and read_kv_states(2)(fe), what="the frontend's KV router and both KV states")
    try:
        # no --kv-overlap-score-weight: the router weighs as the llamacpp workers suggest
        assert re.search(rf"KV router for kvllama: block size \d+, overlap weight {ROUTER_OVERLAP_WEIGHT:.2f} "
                         r"\(suggested by its workers' engine\)", fe.stderr_text()), fe.stderr_text()[-2000:]
        prefix = text(60)
        first, stored = asyncio.run(_request(servers, fe, prefix + " " + text(5), want_blocks=6))
        assert first["overlap_blocks"] == 0 and first["isl_blocks"] >= 6
        second, _ = asyncio.run(_request(servers, fe, prefix + " " + text(5)))
        assert second["worker_id"] == first["worker_id"]
        assert second["overlap_blocks"] >= first["isl_blocks"] - 3
        # and that worker's llama.cpp really reused the prefix
        holder = next(w for w in llama_workers if w.instance_id == first["worker_id"])
        reused = [int(m) for m in re.findall(r"prompt tokens, (\d+) reused from the cache", holder.stderr_text())]
        assert reused[-1] >= second["overlap_blocks"] * BS
    finally:
        fe.stop()
