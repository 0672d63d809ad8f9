"""Workers on one machine lend each other cached prefixes with nothing set: two real llama.cpp workers and
our KV router on the file store (loopback planes, a store of this user's alone), no
``DYN_KV_PREFIX_SHARING``, no fleet secret. (A nats-server carries the events, so the test can watch them;
the workers find each other through the file store.)

Worker A computes a long shared prompt and is then kept busy; the same prompt's next request goes to idle
worker B, which fetches the prefix's KV from A (authenticated by the key in their store) instead of
computing it: B's usage reports the prefix cached and its log the fetch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from harness.events import kv_events, nats_subject, payload
from harness.fleet import kv_frontend, read_kv_states, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import NatsServer
from harness.wait import until
from tests.integration.test_kv_prefix_share_fleet import MODEL, SUBJECT, complete, keep_busy, system
from tests.integration.test_kv_routing import frontend_caught_up

pytestmark = pytest.mark.timeout(300)


def _worker(env: dict[str, str], gguf: Path, args_file: Path) -> DynamoWorker:
    write_engine_args(args_file, {"n_parallel": 2, "n_threads": 1})
    return DynamoWorker(f"in=dyn://{MODEL}.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name", MODEL,
                        "--context-length", "1024", "--extra-engine-args", str(args_file),
                        env={**env, "DYN_LOG": "info,dynamo.disagg.prefix_share=debug"}, startup_timeout=120)


async def _scenario(env: dict[str, str], fe: DynamoRun, a: DynamoWorker, b: DynamoWorker) -> None:
    nc = await nats.connect(env["NATS_SERVER"])
    decisions: list[dict[str, Any]] = []
    a_stored = asyncio.Event()

    async def on_event(msg: Any) -> None:
        for e in kv_events(msg.data):
            on_kv(e)

    def on_kv(e: dict[str, Any]) -> None:
        data = e.get("event", {}).get("data")
        if (e.get("worker_id") == a.instance_id and isinstance(data, dict) and "stored" in data
                and e.get("storage_tier") == "host_pinned"):
            a_stored.set()

    async def on_decision(msg: Any) -> None:
        decisions.append(payload(msg.data))

    busy: list[asyncio.Task[Any]] = []
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            await nc.subscribe(SUBJECT, cb=on_event)
            await nc.subscribe(nats_subject(MODEL, "kv-hit-rate"), cb=on_decision)
            await nc.flush()
            shop = system("bookshop")
            await complete(client, fe, shop + "When do you open?", worker=a.instance_id)
            await asyncio.wait_for(a_stored.wait(), 10)
            await frontend_caught_up(nc, fe, SUBJECT)
            await keep_busy(client, fe, a, busy)
            decisions.clear()
            out = await complete(client, fe, shop + "Do you sell maps?")
            await until(lambda: decisions, 10, "the router's decision")
            assert decisions[-1]["worker_id"] == b.instance_id, decisions  # the idle worker
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= out["usage"]["prompt_tokens"] - 32  # the prefix came from A, not computed on B
            await until(lambda: "KV prefix of" in b.stderr_text(), 10, "B's fetch in its log")
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            await nc.close()


def test_two_workers_on_one_machine_share_a_prefix_with_nothing_set(gguf, tmp_path, monkeypatch):
    for name in ("DYN_KV_PREFIX_SHARING", "DYN_FLEET_SECRET", "DYN_FLEET_SECRET_FILE", "DYN_TCP_RPC_HOST"):
        monkeypatch.delenv(name, raising=False)
    with NatsServer() as nats_server:
        # file discovery as an etcd-less machine gets it (named, so that an etcd on the default port here
        # does not take over)
        env = {"NATS_SERVER": nats_server.url, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "store")}
        a = _worker(env, gguf, tmp_path / "a.json")
        b = _worker(env, gguf, tmp_path / "b.json")
        with workers_running([a, b]):
            for worker in (a, b):
                assert "lending cached KV prefixes at 127.0.0.1:" in worker.stderr_text()
                assert "authenticated by a key in this user's private file store" in worker.stderr_text()
            with kv_frontend(env, ready=read_kv_states(2), what="the frontend to read both workers' KV state") as fe:
                asyncio.run(_scenario(env, fe, a, b))
