#!/usr/bin/env python3
"""What tracing costs: CPU per token of a frontend and a worker with tracing off, on, and (optionally) on
code from before tracing existed.

    .venv/bin/python -m benchmarks.tracing_overhead [--duration 10] [--concurrency 16] [--repeats 3]
                                                    [--baseline-src /path/to/older/checkout/src]

Topology, on loopback, no etcd or NATS (the file store, the TCP request plane):

    load generator --HTTP--> `dynamo-run in=http out=dyn` --TCP--> `dynamo-run in=dyn://bench.backend.generate
                                                                    out=echo_core <tiny model>`

Modes, run interleaved (off, on, baseline, off, on, ...) so that the machine's other load falls on all:
  off       OTEL_EXPORT_ENABLED unset: the hooks are flag tests, nothing of OpenTelemetry is imported
  on        OTEL_EXPORT_ENABLED=true, every request sampled, spans exported over gRPC to a receiver in this
            process (harness/otlp.py), as a collector would take them
  baseline  ``--baseline-src``: the same processes run from another checkout's ``src`` (e.g. a worktree of
            the commit before tracing); what "off" must match

CPU per token = (frontend + worker CPU seconds during the load, from /proc) / content tokens streamed, and
the same per request.  Each request streams its 200-word prompt back (``ignore_eos``: over a thousand
tokens), so the spans' per-request cost is spread over many tokens as in long answers; ``--short`` answers
with about 21 tokens, which weighs that per-request cost as short answers do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import loadgen, machine
from harness.fleet import NO_INFRA_ENV, wait_for_model
from harness.otlp import OtlpReceiver, exporter_env
from harness.proc import DynamoRun, DynamoWorker
from harness.tiny_model import build_tiny_hf_model

ENDPOINT = "dyn://bench.backend.generate"
MODEL = "bench"


def one_run(mode: str, args: argparse.Namespace, model: Path, store: Path, receiver: OtlpReceiver) -> dict[str, Any]:
    env: dict[str, str] = {**NO_INFRA_ENV, "DYN_FILE_KV": str(store / mode)}
    fe_env = dict(env)
    wk_env = dict(env)
    if mode == "on":
        fe_env.update(exporter_env(receiver, "grpc", service="bench-frontend"))
        wk_env.update(exporter_env(receiver, "grpc", service="bench-worker"))
    if mode == "baseline":
        fe_env["PYTHONPATH"] = wk_env["PYTHONPATH"] = str(args.baseline_src)
    else:
        src = str(Path(__file__).resolve().parents[1] / "src")
        fe_env["PYTHONPATH"] = wk_env["PYTHONPATH"] = src
    worker = DynamoWorker(f"in={ENDPOINT}", "out=echo_core", str(model), "--model-name", MODEL, env=wk_env)
    worker.start()
    try:
        with DynamoRun("out=dyn", env=fe_env) as fe:
            wait_for_model(fe, MODEL, ENDPOINT, 1, timeout=30)
            extra = {"ignore_eos": True} if args.long else None  # else the echo ends at the system turn's end
            asyncio.run(loadgen.run_load(fe.base_url, MODEL, concurrency=4, requests=8,
                                         prompt_words=args.prompt_words, extra_body=extra))  # warm up
            w0 = sum(loadgen.tree_cpu_seconds(worker.pid).values())
            result = asyncio.run(loadgen.run_load(fe.base_url, MODEL, concurrency=args.concurrency,
                                                  duration=args.duration, prompt_words=args.prompt_words,
                                                  server_pid=fe.pid, extra_body=extra))
            w1 = sum(loadgen.tree_cpu_seconds(worker.pid).values())
    finally:
        worker.stop()
    tokens = result["tokens"]
    cpu = (result["server_cpu_s"] or 0.0) + (w1 - w0)
    requests = result["requests_ok"]
    return {"mode": mode, "tokens": tokens, "requests": requests, "errors": result["errors"],
            "frontend_cpu_s": result["server_cpu_s"], "worker_cpu_s": w1 - w0,
            "us_per_token": 1e6 * cpu / tokens if tokens else None,
            "us_per_request": 1e6 * cpu / requests if requests else None, "tokens_per_s": result.get("tokens_per_s")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per load run")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent streams")
    ap.add_argument("--prompt-words", type=int, default=200, help="words per prompt (echoed back as tokens)")
    ap.add_argument("--short", dest="long", action="store_false",
                    help="short answers (about 21 tokens: the echo stops at the template's first end of turn), "
                         "which weigh the per-request cost of the spans; default: the whole prompt echoed back")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (the median is shown)")
    ap.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src/ to compare with")
    ap.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = ap.parse_args(argv)
    modes = ["off", "on"] + (["baseline"] if args.baseline_src else [])
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as receiver:
        model = build_tiny_hf_model(Path(tmp), with_weights=False)
        for i in range(args.repeats):
            for mode in modes:
                r = one_run(mode, args, model, Path(tmp) / f"store{i}", receiver)
                print(json.dumps(r), flush=True)
                runs.append(r)
        exported = len(receiver.spans)
    rows = [["mode", "us CPU/token (median)", "runs", "us CPU/request (median)", "tokens/request", "tokens/s"]]
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode and r["us_per_token"]]
        rows.append([mode, f"{statistics.median(r['us_per_token'] for r in mine):.2f}",
                     " ".join(f"{r['us_per_token']:.2f}" for r in mine),
                     f"{statistics.median(r['us_per_request'] for r in mine):.0f}",
                     f"{statistics.median(r['tokens'] / r['requests'] for r in mine):.0f}",
                     f"{statistics.median(r['tokens_per_s'] or 0 for r in mine):.0f}"])
    print(machine.text_table(rows))
    print(f"spans exported in mode 'on': {exported}; load average {machine.format_load(machine.load_average())}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine.describe(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
