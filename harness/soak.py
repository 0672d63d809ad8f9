"""A kv-routed fleet on one machine under sustained mixed load, and the memory of its processes: what
benchmarks/soak.py runs for minutes and tests/integration/test_memory_bounded.py runs for a few thousand
requests.

The fleet is the soak's (benchmarks/soak.py): file discovery (nothing else to start), 2 mocker workers, 1 ``--router-mode kv``
frontend with the Anthropic routes on.  The load is a user's worst case for per-request state: every
prompt unique (so every request adds blocks to the KV router's index and a new prefix everywhere), most
streamed chat, 1 in 10 unary, 1 in 10 dropped by the client after its first token, 1 in 20 with ``n=2``,
and 1 in 20 each on ``/v1/responses`` and ``/v1/messages``.  A request fails when its status is not 200
or a stream ends without its last event (a dropped one only needs its first token).

Memory is read from ``/proc`` (VmRSS and the count of open file descriptors), so the sampler costs the
processes it watches nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import aiohttp

from harness.fleet import sees_model, wait_for_model, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker

MODEL = "soak"
ENDPOINT = f"dyn://{MODEL}.mocker.generate"
# fast (a decode step ~1 ms) and small enough that the workers evict: the KV index must shrink with them
MOCKER_ARGS = {"num_gpu_blocks": 2048, "block_size": 16, "speedup_ratio": 20.0, "max_num_seqs": 64}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo packs".split()


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MB) and open file descriptors of ``pid``, from /proc."""
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
                break
    return {"rss_mb": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``--http-workers``: the frontend processes under their parent)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@dataclass
class Fleet:
    frontend: DynamoRun
    workers: list[DynamoWorker]
    infra: dict[str, int] = field(default_factory=dict)  # etcd, nats-server: name -> pid

    def pids(self) -> dict[str, int]:
        """Every process to sample, by name: with ``--http-workers`` each frontend process and the parent."""
        kids = children(self.frontend.pid)
        out = {"frontend": self.frontend.pid} if not kids else {
            "frontend-parent": self.frontend.pid, **{f"frontend{i}": k for i, k in enumerate(sorted(kids))}}
        out.update({f"worker{i}": w.pid for i, w in enumerate(self.workers)})
        out.update(self.infra)
        return out


@contextmanager
def kv_fleet(model_dir: Path, folder: Path, *, frontend_env: dict[str, str] | None = None,
             workers: int = 2, infra: str = "files", http_workers: int = 0) -> Iterator[Fleet]:
    """The fleet; every process killed at the end.  ``infra``: ``files`` (a private file store under
    ``folder``, TCP request plane, ZMQ events) or ``etcd-nats`` (an etcd and a nats-server of its own);
    ``http_workers``: the frontend as that many processes on one port (``--http-workers``)."""
    with ExitStack() as stack:
        servers: dict[str, int] = {}
        if infra == "files":
            store = folder / "store"
            store.mkdir(mode=0o700, exist_ok=True)
            env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_REQUEST_PLANE": "tcp",
                   "DYN_EVENT_PLANE": "zmq"}
        elif infra == "etcd-nats":
            from harness.servers import EtcdServer, NatsServer

            etcd = stack.enter_context(EtcdServer())
            nats = stack.enter_context(NatsServer())
            env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_DISCOVERY_BACKEND": "etcd",
                   "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"}
            assert etcd.proc is not None and nats.proc is not None
            servers = {"etcd": etcd.proc.pid, "nats": nats.proc.pid}
        else:
            raise ValueError(f"infra {infra!r}: files or etcd-nats")
        yield from _fleet(stack, model_dir, folder, env, frontend_env, workers, http_workers, servers)


def _fleet(stack: ExitStack, model_dir: Path, folder: Path, env: dict[str, str],
           frontend_env: dict[str, str] | None, workers: int, http_workers: int,
           servers: dict[str, int]) -> Iterator[Fleet]:
    args_file = write_engine_args(folder / "mocker.json", MOCKER_ARGS)
    ws = [DynamoWorker(f"in=dyn://{MODEL}.mocker.generate", "out=mocker", str(model_dir), "--model-name", MODEL,
                       "--extra-engine-args", str(args_file), env=env) for _ in range(workers)]
    running = stack.enter_context(workers_running(ws))
    extra = ["--http-workers", str(http_workers)] if http_workers else []
    fe = DynamoRun("out=dyn", "--router-mode", "kv", "--enable-anthropic-api", *extra,
                   env={**env, **(frontend_env or {})})
    stack.enter_context(fe)
    wait_for_model(fe, MODEL, ENDPOINT, workers, timeout=30)
    assert sees_model(MODEL, workers)(fe)
    yield Fleet(fe, running, servers)


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "ok": self.ok, "failed": self.failed, "by_kind": self.by_kind,
                "first_failures": self.failures[:10]}


def unique_prompt(rng: random.Random) -> str:
    """A prompt no other request shares past its first word: 40-120 words (3-8 KV blocks of 16 tokens)."""
    words = [uuid.uuid4().hex] + rng.choices(WORDS, k=rng.randint(40, 120))
    return " ".join(words)


def pick_kind(rng: random.Random) -> str:
    r = rng.random()
    for kind, share in (("unary", 0.10), ("drop", 0.10), ("n2", 0.05), ("responses", 0.05),
                        ("messages", 0.05)):
        if r < share:
            return kind
        r -= share
    return "stream"


async def one_request(session: aiohttp.ClientSession, base: str, kind: str, prompt: str,
                      max_tokens: int) -> str | None:
    """Send one request of ``kind``; None when it succeeded, else why not."""
    messages = [{"role": "user", "content": prompt}]
    stream = kind in ("stream", "drop", "n2", "responses", "messages")
    if kind == "responses":
        path, body = "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens,
                                       "stream": True}
        last = b"response.completed"  # (or response.incomplete: max_output_tokens reached)
    elif kind == "messages":
        path, body = "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                      "stream": True}
        last = b"message_stop"
    else:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
        if kind == "n2":
            body["n"] = 2
        last = b"data: [DONE]"
    async with session.post(base + path, json=body) as resp:
        if resp.status != 200:
            return f"{kind}: HTTP {resp.status} {(await resp.text())[:200]}"
        if not stream:
            data = await resp.json()
            return None if data.get("choices") else f"{kind}: no choices in {str(data)[:200]}"
        seen_last = False
        async for line in resp.content:
            if kind == "drop" and line.startswith(b"data: "):
                return None  # the client goes away after its first event
            if line.startswith(b'data: {"error"') or b'"type":"error"' in line or b"response.failed" in line:
                return f"{kind}: error event {line[:200]!r}"
            if last in line or (kind == "responses" and b"response.incomplete" in line):
                seen_last = True
        return None if seen_last else f"{kind}: stream ended without its last event"


async def mixed_load(base: str, *, clients: int = 64, requests: int | None = None,
                     seconds: float | None = None, max_tokens: int = 12, seed: int = 0,
                     stats: LoadStats | None = None) -> LoadStats:
    """``clients`` concurrent clients sending back to back until ``requests`` were sent or ``seconds``
    passed (whichever is given)."""
    stats = stats or LoadStats()
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds if seconds is not None else None
    timeout = aiohttp.ClientTimeout(total=60)

    def more() -> bool:
        if requests is not None and stats.sent >= requests:
            return False
        return deadline is None or time.monotonic() < deadline

    async def client(session: aiohttp.ClientSession) -> None:
        while more():
            kind = pick_kind(rng)
            stats.sent += 1
            stats.by_kind[kind] = stats.by_kind.get(kind, 0) + 1
            try:
                why = await one_request(session, base, kind, unique_prompt(rng), max_tokens)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                why = f"{kind}: {type(e).__name__}: {e}"
            if why is None:
                stats.ok += 1
            else:
                stats.failed += 1
                stats.failures.append(why)

    # a connection per request: a client that drops closes its connection, and new connections are what
    # a frontend with many users sees
    conn = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return stats


def debug_memory(frontend: DynamoRun, *, top: int = 0, gc_first: bool = True) -> dict[str, Any]:
    """The frontend's ``/debug/memory`` (DYN_DEBUG_MEMORY=1): its structures' sizes, object counts by
    type, and with ``top`` the largest allocation differences since the last call (tracemalloc)."""
    import httpx

    params = {"top": str(top), "gc": "1" if gc_first else "0"}
    resp = httpx.get(frontend.base_url + "/debug/memory", params=params, timeout=60)
    resp.raise_for_status()
    return json.loads(resp.text)
