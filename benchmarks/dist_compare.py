#!/usr/bin/env python3
"""Distributed serving benchmark: our dynamo-run over NATS and over the TCP request plane vs the ORIGINAL
(Rust, ai-dynamo 0.3.2, NATS only).

    .venv/bin/python -m benchmarks.dist_compare [--duration 20] [--only ours,ours-tcp,ours-tcp-secret,original]
                                                [--scenarios a,b] [--repeats 1] [--quiet 0.3]
                                                [--profile DIR [--profile-raw]]

Topology, the same for every implementation, all on loopback:

    load generator --HTTP--> frontend `dynamo-run in=http out=dyn`
                                 |  request: NATS (nats-server with JetStream); `ours-tcp`: straight to the
                                 |    worker's listener (`--request-plane tcp --event-plane zmq` on both)
                                 |  response stream: TCP call-home (every implementation's default)
                                 v
                             worker `dynamo-run in=dyn://bench.backend.generate out=echo_full --model-name bench-echo`

etcd and nats-server come from the infra extra's wheels (harness/servers.py); a fresh pair is
started for every run so the two implementations never see each other's keys.  Each run: start etcd +
NATS, start the worker (with the scenario's DYN_TOKEN_ECHO_DELAY_MS), start the frontend, wait until
`GET /v1/models` lists the model and a chat completion answers, warm up (8 small requests), run the
load from benchmarks/loadgen.py, stop everything (SIGINT, then SIGKILL).

Scenarios (200-word prompts, 1,158 characters = tokens for echo_full, keep-alive connections):
  a  DYN_TOKEN_ECHO_DELAY_MS=0,  64 streams:  tokens/s (the cost of the whole path)
  b  DYN_TOKEN_ECHO_DELAY_MS=10, 256 streams: tokens/s and ITL p99 (ideal: 25,600 tokens/s)

`ours-tcp-secret` is `ours-tcp` with a fleet secret (``DYN_FLEET_SECRET``) on both processes: every
request-plane and call-home connection is authenticated first and the KV events go over CURVE; its ratio
to `ours-tcp` is what authentication costs (docs/security.md has the figures).

"start to first answer s" is from starting the worker and the frontend (at once) until a chat completion
through them answered: a fresh two-process fleet's start-up.

CPU seconds are reported per process (frontend, worker, nats-server, client) from /proc, plus what the
rest of the machine used meanwhile.  The machine is shared: before each run the script waits (up to
--quiet-max-wait s) until it is at most --quiet busy.  `--profile DIR` runs py-spy (pip install py-spy;
found on PATH or beside this interpreter) on our frontend and worker during the load and writes flame
graphs (SVG) there, and with --profile-raw also collapsed stacks (.txt).

Results: a table with ours/original ratios on stdout; JSON in benchmarks/results/dist_compare-<time>.json,
process logs in benchmarks/results/dist-<name>-<time>.log (gitignored).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks import echo_compare, fetch_original, loadgen, machine
from harness.servers import EtcdServer, NatsServer

MODEL = echo_compare.MODEL  # "bench-echo"
ENDPOINT = "dyn://bench.backend.generate"
RESULTS = HERE / "results"

SCENARIOS: dict[str, dict[str, Any]] = {
    "a": {"title": "echo 0 ms/token, 64 streams, 200-word prompts, keep-alive",
          "delay_ms": "0", "load": dict(concurrency=64, prompt_words=200)},
    "b": {"title": "echo 10 ms/token, 256 streams, 200-word prompts, keep-alive",
          "delay_ms": "10", "load": dict(concurrency=256, prompt_words=200)},
}

# what each implementation adds to both processes' command lines
PLANE_ARGS: dict[str, list[str]] = {"ours-tcp": ["--request-plane", "tcp", "--event-plane", "zmq"],
                                    "ours-tcp-secret": ["--request-plane", "tcp", "--event-plane", "zmq"],
                                    "ours": ["--request-plane", "nats", "--event-plane", "nats"]}
# what each implementation adds to both processes' environments
IMPL_ENV: dict[str, dict[str, str]] = {"ours-tcp-secret": {"DYN_FLEET_SECRET": "dist_compare's fleet secret, 40 chars"}}
IMPLEMENTATIONS = ("original", "ours", "ours-tcp", "ours-tcp-secret")

METRICS = [
    # (key, label, better)
    ("ready_s", "start to first answer s", "lower"),
    ("tokens_per_s", "tokens/s", "higher"),
    ("itl_p50", "ITL p50 ms", "lower"),
    ("itl_p99", "ITL p99 ms", "lower"),
    ("ttft_p50", "TTFT p50 ms", "lower"),
    ("ttft_p99", "TTFT p99 ms", "lower"),
    ("frontend_cpu_s", "frontend CPU s", "lower"),
    ("worker_cpu_s", "worker CPU s", "lower"),
    ("nats_cpu_s", "nats-server CPU s", "lower"),
    ("cpu_per_mtok", "frontend+worker CPU s / 1M tok", "lower"),
    ("client_cpu_s", "client CPU s (info)", ""),
    ("background_cpu_s", "other processes' CPU s (info)", ""),
    ("errors", "errors", "lower"),
]


def implementations(args: argparse.Namespace) -> dict[str, list[str]]:
    """name -> the dynamo-run command prefix."""
    only = [n.strip() for n in args.only.split(",")] if args.only else list(IMPLEMENTATIONS)
    out: dict[str, list[str]] = {}
    if "original" in only:
        out["original"] = [str(args.original_bin or fetch_original.fetch())]
    exe = Path(sys.executable).parent / "dynamo-run"
    ours = [str(exe)] if exe.exists() else [sys.executable, "-m", "dynamo.cli"]
    for name in ("ours", "ours-tcp", "ours-tcp-secret"):
        if name in only:
            out[name] = ours
    return out


class Proc:
    """A child in its own process group, output appended to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.cmd = cmd
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")
        self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {name}: {shlex.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise echo_compare.ServerError(f"{self.name} exited with {self.proc.returncode}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def cpu_of(pid: int) -> float:
    return sum(loadgen.tree_cpu_seconds(pid).values())


def wait_ready(url: str, procs: list[Proc], timeout: float = 60.0) -> float:
    """Until /v1/models lists the model and one chat completion answers; returns seconds taken."""
    import http.client

    t0 = time.perf_counter()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    while time.perf_counter() - t0 < timeout:
        for p in procs:
            p.check()
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=5)
            c.request("GET", "/v1/models")
            r = c.getresponse()
            listed = r.status == 200 and MODEL.encode() in r.read()
            if listed:
                c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                if r.status == 200:
                    c.close()
                    return time.perf_counter() - t0
            c.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise echo_compare.ServerError(f"model {MODEL} not served through the frontend after {timeout}s")


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def start_profilers(pids: dict[str, int], duration: float, out_dir: Path, tag: str, raw: bool
                    ) -> list[subprocess.Popen]:
    """py-spy on each process for the load's duration: a flame graph, and collapsed stacks with ``raw``."""
    spy = py_spy()
    if spy is None:
        print("    (py-spy not installed: pip install py-spy; no profile)", flush=True)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    formats = [("flamegraph", "svg")] + ([("raw", "txt")] if raw else [])
    procs = []
    for role, pid in pids.items():
        for fmt, ext in formats:
            procs.append(subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(duration)), "--rate", "100",
                 "--nonblocking", "--format", fmt, "--output", str(out_dir / f"{tag}-{role}.{ext}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def one_run(impl: str, cmd: list[str], key: str, duration: float, stamp: str,
            profile: Path | None, raw_profile: bool, quiet: tuple[float, float] | None = None) -> dict[str, Any]:
    sc = SCENARIOS[key]
    log = RESULTS / f"dist-{impl}-{stamp}.log"
    out: dict[str, Any] = {}
    with EtcdServer() as etcd, NatsServer() as nats:
        env = dict(os.environ)
        for var in ("DYN_LOG", "DYN_LOGGING_JSONL", "RUST_LOG"):
            env.pop(var, None)
        env.update({"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "HF_HUB_OFFLINE": "1"})
        env.pop("DYN_FLEET_SECRET", None)
        env.pop("DYN_FLEET_SECRET_FILE", None)
        env.update(IMPL_ENV.get(impl, {}))
        port = echo_compare.free_port()
        url = f"http://127.0.0.1:{port}"
        planes = PLANE_ARGS.get(impl, [])
        worker = Proc(f"{impl} worker", cmd + [f"in={ENDPOINT}", "out=echo_full", "--model-name", MODEL, *planes],
                      {**env, "DYN_TOKEN_ECHO_DELAY_MS": sc["delay_ms"]}, log)
        frontend = Proc(f"{impl} frontend", cmd + ["in=http", "out=dyn", "--http-port", str(port), *planes], env, log)
        procs = [worker, frontend]
        try:
            out["ready_s"] = wait_ready(url, procs)
            asyncio.run(loadgen.run_load(url, MODEL, concurrency=4, duration=None, requests=8, prompt_words=5))
            if quiet is not None:
                out["machine_busy_before"] = machine.wait_quiet(*quiet, poll=5.0)
            spies = []  # started after the wait for a quiet machine, so they record the load, not the wait
            if profile is not None and impl == "ours":
                spies = start_profilers({"frontend": frontend.pid, "worker": worker.pid}, duration, profile,
                                        f"{stamp}-{key}", raw_profile)
            out["loadavg_before"] = machine.load_average()
            cpu0 = {"frontend": cpu_of(frontend.pid), "worker": cpu_of(worker.pid), "nats": cpu_of(nats.proc.pid),
                    "etcd": cpu_of(etcd.proc.pid)}
            with loadgen.batch_policy(echo_compare.CLIENT_BATCH):
                r = asyncio.run(loadgen.run_load(url, MODEL, duration=duration, server_pid=frontend.pid, **sc["load"]))
            cpu1 = {"frontend": cpu_of(frontend.pid), "worker": cpu_of(worker.pid), "nats": cpu_of(nats.proc.pid),
                    "etcd": cpu_of(etcd.proc.pid)}
            for s in spies:
                try:
                    s.wait(30)
                except subprocess.TimeoutExpired:
                    s.kill()
            r["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
            # what the rest of the machine used meanwhile (other users' work)
            r["cpu_s"]["background"] = max(0.0, r["machine_cpu_busy_s"] - sum(r["cpu_s"].values())
                                           - r["client_cpu_s"])
            out["load"] = r
        finally:
            out["exit_codes"] = {p.name: p.stop() for p in reversed(procs)}
    return out


def metrics(run: dict[str, Any]) -> dict[str, Any]:
    r = run["load"]
    cpu = r["cpu_s"]
    fw = cpu["frontend"] + cpu["worker"]
    return {
        "ready_s": run.get("ready_s"),
        "tokens_per_s": r["tokens_per_s"],
        "itl_p50": r["itl_ms"]["p50"], "itl_p99": r["itl_ms"]["p99"],
        "ttft_p50": r["ttft_ms"]["p50"], "ttft_p99": r["ttft_ms"]["p99"],
        "frontend_cpu_s": cpu["frontend"], "worker_cpu_s": cpu["worker"], "nats_cpu_s": cpu["nats"],
        "cpu_per_mtok": fw / r["tokens"] * 1e6 if r["tokens"] else None,
        "client_cpu_s": r["client_cpu_s"], "background_cpu_s": cpu.get("background"), "errors": r["errors"],
    }


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    ms = [metrics(r) for r in runs if "load" in r]
    if not ms:
        return {}
    out = {}
    for k in ms[0]:
        vals = [m[k] for m in ms if m[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


RATIOS = (("ours-tcp", "ours"), ("ours", "original"), ("ours-tcp", "original"), ("ours-tcp-secret", "ours-tcp"))


def table(results: dict[str, dict[str, dict[str, Any]]], order: list[str]) -> str:
    names = [n for n in IMPLEMENTATIONS if any(n in results.get(k, {}) for k in order)]
    ratios = [(a, b) for a, b in RATIOS if a in names and b in names]
    rows = [("scen", "metric", *names, *(f"{a}/{b}" for a, b in ratios), "better")]
    for key in order:
        ms = {n: results.get(key, {}).get(n, {}).get("metrics", {}) for n in names}
        for m, label, better in METRICS:
            vals = {n: ms[n].get(m) for n in names}
            if all(v is None for v in vals.values()):
                continue
            cells = []
            for a, b in ratios:
                u, o = vals[a], vals[b]
                cells.append(f"{u / o:.2f}" if isinstance(o, (int, float)) and isinstance(u, (int, float)) and o
                             else "-")
            rows.append((key, label, *(echo_compare.fmt(vals[n]) for n in names), *cells, better))
    return machine.text_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per load run")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma list from " + ",".join(IMPLEMENTATIONS) + " (default: all)")
    ap.add_argument("--scenarios", default="a,b", help="comma list from a,b")
    ap.add_argument("--repeats", type=int, default=1, help="runs per scenario and implementation (median shown)")
    ap.add_argument("--original-bin", type=Path, default=None,
                    help="path of the original dynamo-run (default: fetch ai-dynamo==0.3.2)")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy flame graphs of ours into this folder")
    ap.add_argument("--profile-raw", action="store_true", help="with --profile: also collapsed stacks (.txt)")
    ap.add_argument("--quiet", type=float, default=0.3, metavar="SHARE",
                    help="before each run wait until the machine is at most this busy (0-1; default 0.3); "
                         "1 disables the wait")
    ap.add_argument("--quiet-max-wait", type=float, default=600.0, help="give up waiting after this many seconds")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--client-batch", action="store_true",
                    help="run the load generator as SCHED_BATCH, so that its wake-ups do not preempt the "
                         "servers on a shared core (as a client on another machine; loadgen.batch_policy)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = ap.parse_args()
    for name in (args.only or "").split(","):
        if name.strip() and name.strip() not in IMPLEMENTATIONS:
            ap.error(f"--only: unknown implementation {name.strip()!r}")

    uv = False if args.no_uvloop else loadgen.install_uvloop()
    echo_compare.CLIENT_BATCH = args.client_batch
    order = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in order:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
    impls = implementations(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {
        **machine.describe(), "uvloop": uv, "client_batch": args.client_batch,
        "duration_s": args.duration, "repeats": args.repeats,
        "scenarios": {k: SCENARIOS[k]["title"] for k in order},
        "commands": {name: shlex.join(cmd) for name, cmd in impls.items()},
    }
    print(f"dist_compare: {meta['cpus']} CPUs ({meta['cpu_model']}), "
          f"load average {machine.format_load(meta['loadavg_at_start'])}, "
          f"uvloop={uv}", flush=True)
    for name, cmd in impls.items():
        planes = " ".join(PLANE_ARGS.get(name, []))
        print(f"  {name}: {shlex.join(cmd)} in=http out=dyn {planes}  +  {shlex.join(cmd)} in={ENDPOINT} "
              f"out=echo_full {planes}")

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for key in order:
        print(f"\n== scenario {key}: {SCENARIOS[key]['title']}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in impls}
        for i in range(args.repeats):  # alternate the implementations so background load hits both alike,
            # and reverse their order every other repeat, so that none always runs first or last
            for name, cmd in (list(impls.items()) if i % 2 == 0 else list(reversed(impls.items()))):
                print(f"  -- {name}" + (f" (run {i + 1})" if args.repeats > 1 else ""), flush=True)
                try:
                    run = one_run(name, cmd, key, args.duration, stamp, args.profile, args.profile_raw,
                                  (args.quiet, args.quiet_max_wait) if args.quiet < 1 else None)
                except echo_compare.ServerError as e:
                    print(f"    FAILED: {e}", flush=True)
                    runs[name].append({"error": str(e)})
                    continue
                runs[name].append(run)
                r = run["load"]
                print("    " + loadgen.format_result(r).replace("\n", "\n    "), flush=True)
                c = r["cpu_s"]
                print(f"    CPU s: frontend {c['frontend']:.2f} worker {c['worker']:.2f} nats {c['nats']:.2f} "
                      f"etcd {c['etcd']:.2f}; other processes {c['background']:.2f}", flush=True)
        results[key] = {name: {"runs": rs, "metrics": median_metrics(rs)} for name, rs in runs.items()}

    print("\n" + table(results, order))
    out = args.out or RESULTS / f"dist_compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
