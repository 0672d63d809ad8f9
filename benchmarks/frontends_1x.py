#!/usr/bin/env python3
"""Our frontend against Dynamo 1.6.1's, in front of the SAME workers: the frontends' cost, measured at last.

    PYTHONPATH=src .venv/bin/python -m benchmarks.frontends_1x [--workers d16-mocker|ours-mocker|llamacpp]
        [--streams 64,256] [--duration 20] [--repeats 1] [--only ours,d16] [--quiet 0.3]

``--only ours-2,...``: ours with ``--http-workers 2`` (two frontend processes on one port, as a user gives a
frontend more than one core; its CPU is the process tree's).

Topology, one machine, file discovery (one ``DYN_FILE_KV`` per run), TCP request plane, ZMQ events:

    load generator --HTTP--> frontend (ours: `dynamo-run in=http out=dyn --router-mode kv`;
                             1.6.1: `python -m dynamo.frontend --router-mode kv`)
                                 |  1.6.1's TCP request plane, msgpack (both frontends speak it to these workers)
                                 v
                             2 workers, started once per run and shared by nothing else:
                             `d16-mocker`: 1.6.1's `python -m dynamo.mocker` (its timing model, speedup 1)
                             `ours-mocker`: ours, `dynamo-run in=dyn://... out=mocker` (our frontend to our
                                workers: the worker detokenizes; ``--only ours``)
                             `llamacpp`:   ours, `dynamo-run in=dyn://... out=llamacpp` on SmolLM2

Per run: start the two workers, then the frontend; wait until it lists the model and answers; warm up; the
load (benchmarks/loadgen.py: C streaming chat clients, 200-word prompts, ``max_tokens`` 64); stop the
frontend.  The workers are the same processes for both frontends within one repeat, run one after the other,
so what differs is the frontend.  Reported per frontend and stream count: tokens/s, TTFT and ITL p50/p99, and
the frontend process's CPU seconds per 1,000 tokens (from /proc).  The ratio ours/1.6.1 is what counts (the
machine has 2 shared cores: compare within a run, repeat, report the spread).

1.6.1 comes from ``.venv-dynamo1x`` (``scripts/setup-dynamo1x-venv.sh``) or ``DYN16_PYTHON``.  Results:
a table on stdout, JSON in benchmarks/results/frontends_1x-<time>.json, logs beside it (gitignored).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import dist_compare, loadgen, machine
from harness.dynamo1x import build_tiny_chat_5k, d16_env, d16_python
from harness.proc import cli_command, free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

ENDPOINT = "dyn://bench.backend.generate"


def our_env(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = str(REPO / "src")
    return env


def start_workers(kind: str, env: dict[str, str], model_dir: Path, log: Path) -> tuple[list[dist_compare.Proc], str]:
    """Two workers of ``kind`` on ``ENDPOINT``; returns them and the served model's name."""
    procs = []
    if kind == "d16-mocker":
        python = d16_python()
        if python is None:
            raise SystemExit("Dynamo 1.6.1 is not installed: scripts/setup-dynamo1x-venv.sh")
        for i in range(2):
            procs.append(dist_compare.Proc(f"d16-mocker-{i}", [
                str(python), "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", "bench",
                "--endpoint", ENDPOINT], env, log))
        return procs, "bench"
    if kind == "ours-mocker":
        for i in range(2):
            procs.append(dist_compare.Proc(f"mocker-{i}", [
                *cli_command(), f"in={ENDPOINT}", "out=mocker", str(model_dir), "--model-name", "bench"],
                our_env(env), log))
        return procs, "bench"
    model = Path(os.popen(str(REPO / "scripts" / "smollm2-path.sh")).read().strip())
    for i in range(2):
        procs.append(dist_compare.Proc(f"llamacpp-{i}", [
            *cli_command(), f"in={ENDPOINT}", "out=llamacpp", str(model), "--model-name", "bench"], our_env(env), log))
    return procs, "bench"


def frontend_cmd(which: str, port: int) -> list[str]:
    if which.startswith("ours"):  # ours-N: --http-workers N (N processes on one port; CPU summed over the tree)
        extra = ["--http-workers", which.split("-", 1)[1]] if "-" in which else []
        return [*cli_command(), "in=http", "out=dyn", "--http-host", "127.0.0.1", "--http-port", str(port),
                "--router-mode", "kv", *extra]
    python = d16_python()
    assert python is not None
    return [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
            "--router-mode", "kv"]


def one_run(which: str, streams: int, duration: float, env: dict[str, str], workers: list[dist_compare.Proc],
            log: Path) -> dict[str, Any]:
    port = free_port()
    fenv = our_env(env) if which.startswith("ours") else env
    frontend = dist_compare.Proc(f"frontend-{which}", frontend_cmd(which, port), fenv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [frontend, *workers], timeout=120)
        asyncio.run(loadgen.run_load(url, "bench", concurrency=8, requests=16, max_tokens=16))
        result = asyncio.run(loadgen.run_load(url, "bench", concurrency=streams, duration=duration,
                                              max_tokens=64, server_pid=frontend.pid))
    finally:
        frontend.stop()
    tokens = result["tokens"] or 1
    result["frontend_cpu_ms_per_token"] = 1000.0 * (result["server_cpu_s"] or 0.0) / tokens
    return result


def wait_ready(url: str, procs: list[dist_compare.Proc], timeout: float) -> None:
    """Until one chat completion answers through the frontend (1.6.1's mocker requires ``max_tokens``)."""
    import httpx

    deadline = time.monotonic() + timeout
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    last = ""
    while time.monotonic() < deadline:
        for p in procs:
            p.check()
        try:
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
            if reply.status_code == 200:
                return
            last = reply.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise SystemExit(f"the frontend at {url} did not answer in {timeout}s: {last[:300]}")


def row(which: str, streams: int, r: dict[str, Any]) -> list[str]:
    return [which, str(streams), f"{r['tokens_per_s']:.0f}", f"{r['ttft_ms']['p50']:.1f}", f"{r['ttft_ms']['p99']:.1f}",
            f"{r['itl_ms']['p50']:.1f}", f"{r['itl_ms']['p99']:.1f}", f"{r['frontend_cpu_ms_per_token']:.3f}",
            str(r["errors"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", choices=["d16-mocker", "ours-mocker", "llamacpp"], default="d16-mocker")
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default="ours,d16")
    ap.add_argument("--quiet", type=float, default=0.3)
    ap.add_argument("--quiet-max-wait", type=float, default=300.0)
    args = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    log = out_dir / f"frontends_1x-{stamp}.log"
    which_list = args.only.split(",")
    results: list[dict[str, Any]] = []
    rows = [["frontend", "streams", "tokens/s", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99",
             "frontend CPU ms/token", "errors"]]
    tmp = Path(tempfile.mkdtemp(prefix="frontends1x-"))
    try:
        model_dir = build_tiny_chat_5k(tmp / "model", name="bench")
        for repeat in range(args.repeats):
            store = tmp / f"store-{repeat}"
            store.mkdir()
            env = d16_env(store)
            workers, _ = start_workers(args.workers, env, model_dir, log)
            try:
                for streams in [int(s) for s in args.streams.split(",")]:
                    order = which_list if repeat % 2 == 0 else list(reversed(which_list))
                    for which in order:
                        busy = machine.wait_quiet(args.quiet, args.quiet_max_wait)
                        r = one_run(which, streams, args.duration, env, workers, log)
                        r.update(frontend=which, streams=streams, repeat=repeat, busy_before=busy)
                        results.append(r)
                        rows.append(row(which, streams, r))
                        print(machine.text_table([rows[0], rows[-1]]).splitlines()[-1], flush=True)
            finally:
                for w in workers:
                    w.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(machine.text_table(rows))
    path = out_dir / f"frontends_1x-{stamp}.json"
    path.write_text(json.dumps({"meta": {**machine.describe(), "args": vars(args)}, "runs": results}, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
