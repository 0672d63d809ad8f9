"""Scaling down without failing a request: a worker that gets SIGTERM deregisters first, finishes what it
runs (or, past ``--drain-timeout``, hands it back to the frontend, which resumes it on another worker),
then exits 0.  Real etcd, nats-server, frontend and workers; a steady stream of streamed requests from
an async client while one of two workers is stopped.

The drain-timeout case uses the deterministic engine (``harness/det_engine.py``), so a request resumed on
the other worker is checked token for token: nothing lost, nothing repeated.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.det_engine import next_token, word_tokens
from harness.fleet import health_instances, metric
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)

ENGINE = Path(__file__).resolve().parents[2] / "harness" / "det_engine.py"
LOG = "info,dynamo.worker.handlers=debug"  # a worker logs "request <id>" for each request
MOCKER_ARGS = {"speedup_ratio": 1.0, "block_size": 16, "num_gpu_blocks": 4096}


@dataclass
class Outcome:
    rid: str
    max_tokens: int
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    chunks: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream_one(client: httpx.AsyncClient, model: str, max_tokens: int, tag: str) -> Outcome:
    out = Outcome(f"{tag}-{uuid.uuid4().hex[:12]}", max_tokens)
    body = {"model": model, "messages": [{"role": "user", "content": "go on"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": out.rid}) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    continue
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    out.chunks += 1
                    out.started.set()
                    out.text += choice["delta"].get("content") or ""
                    out.finish = choice.get("finish_reason") or out.finish
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


class SteadyLoad:
    """``streams`` clients, each sending one streamed request after another until stopped."""

    def __init__(self, base_url: str, model: str, max_tokens: int, streams: int) -> None:
        self.client = httpx.AsyncClient(base_url=base_url, timeout=60)
        self.model, self.max_tokens, self.streams = model, max_tokens, streams
        self.done: list[Outcome] = []
        self.running: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.streams)]

    async def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            task = asyncio.create_task(stream_one(self.client, self.model, self.max_tokens, f"load{i}"))
            out = await task
            self.done.append(out)

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.client.aclose()
        return self.done


def requests_logged(worker: DynamoWorker, tag: str) -> int:
    """Requests whose id starts with ``tag`` that the worker took (its debug log names each one)."""
    return worker.stderr_text().count(f"request {tag}")


def assert_all_whole(outcomes: list[Outcome]) -> None:
    failed = [o for o in outcomes if o.error or o.finish != "length" or o.completion_tokens != o.max_tokens]
    assert not failed, [(o.rid, o.error, o.finish, o.completion_tokens) for o in failed[:5]]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_LOG": LOG, "DET_TOKEN_DELAY_MS": "30"}


@pytest.fixture(scope="module")
def frontend(env) -> Iterator[DynamoRun]:
    # no --migration-limit: a drained request is resumed elsewhere whatever the limit
    with DynamoRun("out=dyn", env=env) as fe:
        yield fe


def start_pair(*args: str, env: dict[str, str]) -> list[DynamoWorker]:
    workers = [DynamoWorker(*args, env=env).start(wait=False) for _ in range(2)]
    for w in workers:
        w.wait_ready()
    return workers


def test_sigterm_under_steady_load_fails_nothing_and_exits_zero(env, frontend, tiny_model, tmp_path):
    args_file = tmp_path / "mocker.json"
    args_file.write_text(json.dumps(MOCKER_ARGS))
    endpoint = "drain.mocker.generate"
    workers = start_pair(f"in=dyn://{endpoint}", "out=mocker", str(tiny_model), "--model-name", "drainm",
                         "--extra-engine-args", str(args_file), env=env)
    try:
        wait_until(lambda: len(health_instances(frontend, f"dyn://{endpoint}")) == 2, 15, "two mocker workers")
        leaving, staying = workers

        async def scenario() -> tuple[list[Outcome], float]:
            load = SteadyLoad(frontend.base_url, "drainm", max_tokens=40, streams=6)
            load.start()
            # both workers are streaming before one is told to go
            await asyncio.to_thread(wait_until, lambda: requests_logged(leaving, "load") >= 3
                                    and requests_logged(staying, "load") >= 3,
                                    20, "both workers serving")
            served_before = requests_logged(leaving, "load")
            leaving.terminate()
            signalled = time.monotonic()
            rc = await asyncio.to_thread(leaving.wait, 30)
            exited_after = time.monotonic() - signalled
            assert rc == 0, leaving.stderr_text()[-3000:]
            # it took no request after the signal, and the load kept going on the other worker
            assert requests_logged(leaving, "load") == served_before
            after = len(load.done)
            await asyncio.to_thread(wait_until, lambda: len(load.done) >= after + 6, 30, "requests after the exit")
            return await load.stop(), exited_after

        outcomes, exited_after = asyncio.run(scenario())
        assert len(outcomes) >= 12
        assert_all_whole(outcomes)
        # the requests it ran were finished there, not moved: the drain waited for them
        assert metric(frontend, "dynamo_frontend_model_migration_total", model="drainm",
                      migration_type="ongoing_request") == 0
        assert exited_after < 25
        assert health_instances(frontend, f"dyn://{endpoint}") == {staying.instance_id}
    finally:
        for w in workers:
            w.kill()


def test_drain_timeout_hands_running_streams_to_the_other_worker_exactly(env, frontend, tiny_model):
    endpoint = "drain.det.generate"
    model = "draind"
    workers = start_pair(f"in=dyn://{endpoint}", f"out=pytok:{ENGINE}", str(tiny_model), "--model-name", model,
                         "--drain-timeout", "0.5", env=env)
    words = word_tokens(tiny_model)
    ids, by_word = sorted(words), {w: i for i, w in words.items()}
    try:
        wait_until(lambda: len(health_instances(frontend, f"dyn://{endpoint}")) == 2, 15, "two det workers")
        leaving, staying = workers
        before = metric(frontend, "dynamo_frontend_model_migration_total", model=model,
                        migration_type="ongoing_request")

        async def scenario() -> tuple[list[Outcome], float]:
            async with httpx.AsyncClient(base_url=frontend.base_url, timeout=60) as client:
                # long streams (150 tokens, 30 ms apart: 4.5 s), far past the 0.5 s drain timeout
                tasks = [asyncio.create_task(stream_one(client, model, 150, f"long{i}")) for i in range(6)]
                await asyncio.to_thread(wait_until, lambda: requests_logged(leaving, "long") >= 2, 20,
                                        "long streams on the leaving worker")
                leaving.terminate()
                signalled = time.monotonic()
                rc = await asyncio.to_thread(leaving.wait, 20)
                assert rc == 0, leaving.stderr_text()[-3000:]
                exited_after = time.monotonic() - signalled
                return list(await asyncio.gather(*tasks)), exited_after

        outcomes, exited_after = asyncio.run(scenario())
        assert exited_after < 5, "the worker waited past its drain timeout"
        assert_all_whole(outcomes)
        for o in outcomes:  # token for token: each word follows from the one before, across the move
            toks = [by_word[w] for w in o.text.split()]
            assert len(toks) == 150
            assert all(b == next_token(a, ids) for a, b in zip(toks, toks[1:], strict=False)), o.rid
        moved = metric(frontend, "dynamo_frontend_model_migration_total", model=model,
                       migration_type="ongoing_request") - before
        assert moved >= 2
        assert "handing them to other workers" in leaving.stderr_text()
        assert health_instances(frontend, f"dyn://{endpoint}") == {staying.instance_id}
    finally:
        for w in workers:
            w.kill()
